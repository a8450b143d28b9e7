"""Stage-to-stage transports. ``shm_ring``: the shared-memory chunk ring (talker → code2wav)."""

from omni_tts.connectors.shm_ring import (
    FLAG_IS_CONTEXT,
    FLAG_IS_LAST,
    MAX_REQUEST_ID_BYTES,
    Chunk,
    ChunkReader,
    ChunkWriter,
    ReaderStats,
    RingOwner,
    RingSpec,
    WriterStats,
    cleanup_stale_segments,
)

__all__ = [
    "FLAG_IS_CONTEXT", "FLAG_IS_LAST", "MAX_REQUEST_ID_BYTES", "Chunk", "ChunkReader", "ChunkWriter", "ReaderStats",
    "RingOwner", "RingSpec", "WriterStats", "cleanup_stale_segments",
]
