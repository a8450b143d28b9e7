"""The connector kinds a stage config can name: the spec that travels in the launch message (a msgspec tagged union)
and the writer and reader each spec stands for."""

from __future__ import annotations

import threading
from typing import Callable

from omni_tts.connectors.base import ChunkReaderBase, ChunkWriterBase
from omni_tts.connectors.shm_ring import ChunkReader, ChunkWriter, RingSpec
from omni_tts.connectors.tcp import TcpChunkReader, TcpChunkWriter, TcpSpec

ConnectorSpec = RingSpec | TcpSpec


def chunk_writer(spec: ConnectorSpec, on_error: Callable[[BaseException], None] | None = None) -> ChunkWriterBase:
    """The talker's end of the connector `spec` describes (not started)."""
    if isinstance(spec, TcpSpec):
        return TcpChunkWriter(spec, on_error)
    return ChunkWriter(spec, on_error)


def chunk_reader(spec: ConnectorSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> ChunkReaderBase:
    """Code2wav's end of the connector `spec` describes (not started)."""
    if isinstance(spec, TcpSpec):
        return TcpChunkReader(spec, condition, on_error)
    return ChunkReader(spec, condition, on_error)
