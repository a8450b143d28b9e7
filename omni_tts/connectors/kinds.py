"""The connector kinds a stage config can name: the owner the orchestrator creates for each, the spec that travels in
the launch message (a msgspec tagged union), and the writer and reader each spec stands for."""

from __future__ import annotations

import threading
from typing import Callable

from omni_tts.config import ConnectorConfig
from omni_tts.connectors.base import ChunkReaderBase, ChunkWriterBase
from omni_tts.connectors.local import LocalOwner, LocalSpec
from omni_tts.connectors.shm_ring import ChunkReader, ChunkWriter, RingOwner, RingSpec
from omni_tts.connectors.tcp import TcpChunkReader, TcpChunkWriter, TcpOwner, TcpSpec

ConnectorSpec = RingSpec | TcpSpec | LocalSpec
ConnectorOwner = RingOwner | TcpOwner | LocalOwner


def create_owner(conn: ConnectorConfig, num_codebooks: int) -> ConnectorOwner:
    """The talker → code2wav connector of the configured kind, created before either stage starts."""
    if conn.kind == "tcp":
        return TcpOwner.create(conn.ring_slots, conn.ring_slot_frames, num_codebooks, conn.tcp_host, conn.tcp_port)
    if conn.kind == "local":
        return LocalOwner.create(conn.ring_slots, conn.ring_slot_frames, num_codebooks)
    return RingOwner.create(conn.ring_slots, conn.ring_slot_frames, num_codebooks, edge="codec")


def chunk_writer(spec: ConnectorSpec, on_error: Callable[[BaseException], None] | None = None) -> ChunkWriterBase:
    """The talker's end of the connector `spec` describes (not started); an in-process connector's two ends are
    made together (connectors.local.local_pair)."""
    _check_not_local(spec)
    if isinstance(spec, TcpSpec):
        return TcpChunkWriter(spec, on_error)
    return ChunkWriter(spec, on_error)


def chunk_reader(spec: ConnectorSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> ChunkReaderBase:
    """Code2wav's end of the connector `spec` describes (not started)."""
    _check_not_local(spec)
    if isinstance(spec, TcpSpec):
        return TcpChunkReader(spec, condition, on_error)
    return ChunkReader(spec, condition, on_error)


def _check_not_local(spec: ConnectorSpec) -> None:
    if isinstance(spec, LocalSpec):
        raise ValueError("an in-process connector's ends are made together, in the process that runs both stages "
                         "(connectors.local.local_pair)")
