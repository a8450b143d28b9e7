"""Stage-to-stage transports. ``shm_ring``: the shared-memory chunk ring (talker → code2wav); ``base``: what every
transport shares (Chunk, stats, slot bookkeeping)."""

from omni_tts.connectors.base import (
    FLAG_IS_CONTEXT,
    FLAG_IS_LAST,
    MAX_REQUEST_ID_BYTES,
    Chunk,
    ReaderStats,
    WriterStats,
)
from omni_tts.connectors.shm_ring import ChunkReader, ChunkWriter, RingOwner, RingSpec, cleanup_stale_segments

__all__ = [
    "FLAG_IS_CONTEXT", "FLAG_IS_LAST", "MAX_REQUEST_ID_BYTES", "Chunk", "ChunkReader", "ChunkWriter", "ReaderStats",
    "RingOwner", "RingSpec", "WriterStats", "cleanup_stale_segments",
]
