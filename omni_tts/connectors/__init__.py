"""Stage-to-stage transports (talker → code2wav), one per kind behind one interface (``base``): ``shm_ring``, the
shared-memory chunk ring for stages on one host, ``tcp``, one pyzmq TCP connection for a code2wav on another
host, and ``local``, the fused layout's in-process hand-over. ``kinds`` maps a spec to its writer and reader."""

from omni_tts.connectors.base import (
    FLAG_IS_CONTEXT,
    FLAG_IS_LAST,
    MAX_REQUEST_ID_BYTES,
    ChunkReaderBase,
    ChunkWriterBase,
    ReaderStats,
    SlotView,
    WriterStats,
)
from omni_tts.connectors.kinds import ConnectorSpec, chunk_reader, chunk_writer
from omni_tts.connectors.shm_ring import ChunkReader, ChunkWriter, RingOwner, RingSpec, cleanup_stale_blocks
from omni_tts.connectors.tcp import TcpChunkReader, TcpChunkWriter, TcpOwner, TcpSpec

__all__ = [
    "FLAG_IS_CONTEXT", "FLAG_IS_LAST", "MAX_REQUEST_ID_BYTES", "ChunkReader", "ChunkReaderBase", "ChunkWriter",
    "ChunkWriterBase", "ConnectorSpec", "ReaderStats", "RingOwner", "RingSpec", "SlotView", "TcpChunkReader",
    "TcpChunkWriter", "TcpOwner", "TcpSpec", "WriterStats", "chunk_reader", "chunk_writer", "cleanup_stale_blocks",
]
