"""TCP chunk connector: the talker → code2wav edge over one pyzmq TCP connection, so code2wav can run on another host.

Who does what
-------------
* The **owner** (the orchestrator) calls :meth:`TcpOwner.create` at start-up and passes ``owner.spec`` (a msgspec
  :class:`TcpSpec`) to both stages. Given port 0 it picks a free port and holds it until :meth:`TcpOwner.close`
  (a bound, not listening socket with SO_REUSEADDR, which the reader's listening socket may share), so no other
  process takes the port before the reader binds it.
* The **reader** (code2wav process) runs :class:`TcpChunkReader`: it binds a DEALER at ``spec.address``; one I/O
  thread turns arriving messages into :class:`Chunk` objects whose ``codes`` are zero-copy views into the received
  frame, and sends back the slots that ``release`` passes it over an inproc pipe (a zmq socket belongs to one
  thread).
* The **writer** (talker process) runs :class:`TcpChunkWriter`: ``put`` only enqueues; one I/O thread connects a
  DEALER, sends queued chunks while it holds free slots (credits) and takes the slots the reader sends back.

One connection carries both directions: a release goes back on the connection its chunk came in on, so it can
never be sent before the reader has a peer to send it to. The writer connects with ZMQ_IMMEDIATE off: what it sends
before the reader binds waits in its queue, so either stage may start first.

Wire format (little-endian), one two-frame message per chunk::

    frame 0: b"otc1" | slot u32 | seq i64 | put_ns i64 | num_frames u32 | flags u32 | request id (≤ 64 UTF-8 bytes)
    frame 1: payload: num_frames × num_codebooks int32, row-major

and a release is the slot index alone (u32). At most ``num_slots`` chunks are in flight, as in the shared-memory
ring, so memory on both ends stays bounded the same way. There is no authentication: bind a loopback or private
address. ``put_ns`` is the writer host's monotonic clock; the put → get latency the reader derives from it is
meaningful only while both stages share a host.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
from typing import Callable

import msgspec
import numpy as np
import zmq

from omni_tts.connectors.base import (MAX_REQUEST_ID_BYTES, SLOT_MSG, Chunk, ChunkReaderBase, ChunkWriterBase,
                                      QueuedChunk, connect, drain_slots, stop_threads, unbounded_socket, wake_pair)

logger = logging.getLogger(__name__)

_MAGIC = b"otc1"  # names the format: a peer of another version is refused, not misread
_HEADER = struct.Struct("<4sIqqII")  # magic, slot, seq, put time (CLOCK_MONOTONIC ns), num_frames, flags; id follows
_CLOSE_LINGER_MS = 100  # the reader's close() still delivers the releases already made, if the writer takes them


class TcpSpec(msgspec.Struct, frozen=True, tag="tcp"):
    """Everything a stage process needs to join one TCP connector; msgspec-serializable."""

    host: str  # an IP address of the reader's host: the reader binds it, the writer connects to it
    port: int
    num_slots: int  # chunks in flight: the writer's credits
    max_frames: int
    num_codebooks: int

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    @property
    def address(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if self.ipv6 else f"tcp://{self.host}:{self.port}"


class TcpOwner:
    """Picks the connector's address at start-up; with a picked port, holds it until :meth:`close`."""

    def __init__(self, spec: TcpSpec, reservation: socket.socket | None) -> None:
        self.spec = spec
        self._reservation = reservation

    @classmethod
    def create(cls, num_slots: int, max_frames: int, num_codebooks: int = 16, host: str = "127.0.0.1",
               port: int = 0) -> TcpOwner:
        """`host`: an IP address of the reader's host; `port` 0 picks a free one there (only possible when that is
        this host)."""
        if num_slots < 1 or max_frames < 1 or num_codebooks < 1:
            raise ValueError("num_slots, max_frames and num_codebooks must be >= 1")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        version = ipaddress.ip_address(host).version  # ValueError for a name: zmq binds addresses, not names
        reservation = None
        if port == 0:
            reservation = socket.socket(socket.AF_INET6 if version == 6 else socket.AF_INET, socket.SOCK_STREAM)
            try:
                reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # zmq's listener sets it too
                reservation.bind((host, 0))
            except OSError as exc:
                reservation.close()
                raise OSError(exc.errno, f"cannot pick a free TCP port on {host} ({exc.strerror}); give the "
                                         f"connector's tcp_port when code2wav runs on another host") from None
            port = reservation.getsockname()[1]
        spec = TcpSpec(host=host, port=port, num_slots=num_slots, max_frames=max_frames, num_codebooks=num_codebooks)
        return cls(spec, reservation)

    def close(self) -> None:
        """Give the picked port back; safe to call twice."""
        reservation, self._reservation = self._reservation, None
        if reservation is not None:
            reservation.close()

    def __enter__(self) -> TcpOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _encode(slot: int, chunk: QueuedChunk) -> list[bytes | np.ndarray]:
    rid, seq, put_ns, codes, flags = chunk
    return [_HEADER.pack(_MAGIC, slot, seq, put_ns, codes.shape[0], flags) + rid, codes.astype("<i4", copy=False)]


def _claimed_slot(frames: list[zmq.Frame], num_slots: int) -> int | None:
    """The slot a message says it occupies, if it says one that exists: given back even if the rest is unreadable."""
    header = frames[0].bytes
    if len(header) < _HEADER.size or header[:4] != _MAGIC:
        return None
    slot = _HEADER.unpack_from(header)[1]
    return slot if slot < num_slots else None


def _decode(frames: list[zmq.Frame], spec: TcpSpec) -> Chunk:
    """A received message as a Chunk viewing its payload frame; ValueError (UnicodeDecodeError for the id) for
    anything a writer of this format would not send."""
    header = frames[0].bytes
    if len(frames) != 2 or len(header) < _HEADER.size or header[:4] != _MAGIC:
        raise ValueError(f"not a chunk message: {len(frames)} frames, header of {len(header)} bytes")
    _, slot, seq, put_ns, num_frames, flags = _HEADER.unpack_from(header)
    raw_id, payload = header[_HEADER.size:], frames[1].buffer
    if (slot >= spec.num_slots or num_frames > spec.max_frames or len(raw_id) > MAX_REQUEST_ID_BYTES
            or payload.nbytes != num_frames * spec.num_codebooks * 4):
        raise ValueError(f"corrupt chunk header: slot={slot} frames={num_frames} id_len={len(raw_id)} "
                         f"payload={payload.nbytes} bytes")
    codes = np.frombuffer(payload, "<i4").reshape(num_frames, spec.num_codebooks)
    codes.flags.writeable = False  # the reader must never scribble on what it was sent
    return Chunk.from_wire(raw_id, seq, put_ns, codes, flags, slot)


def _discard_all(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def _drain_messages(sock: zmq.Socket) -> list[list[zmq.Frame]]:
    """Every message already queued on `sock`, as zero-copy frames."""
    messages = []
    while True:
        try:
            messages.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            return messages


class TcpChunkWriter(ChunkWriterBase):
    """Talker side. ``put`` never blocks; one I/O thread sends chunks in put order while it holds free slots, and
    takes back the slots the reader releases.

    When every slot is held by the reader, the I/O thread waits for a release (back-pressure) while ``put`` keeps
    queueing; watch ``pending()`` to throttle the engine if the queue grows.
    """

    spec: TcpSpec

    def __init__(self, spec: TcpSpec, on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(spec, on_error)
        self._ctx: zmq.Context | None = None
        self._kick: zmq.Socket | None = None  # put() and close() → the I/O thread blocked in poll
        self._parked = False  # the I/O thread found nothing to send: the next put() kicks it

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("TcpChunkWriter already started")
        self._ctx = zmq.Context(io_threads=1)
        link = connect(self._ctx, zmq.DEALER, self.spec.address, self.spec.ipv6)
        self._kick, kicked = wake_pair(self._ctx, "tcp-writer")
        self._threads = [threading.Thread(target=self._io_loop, args=(link, kicked), name="omni-tts-tcp-send",
                                          daemon=True)]
        self._threads[0].start()

    def _wake_sender_locked(self) -> None:
        # only a parked thread needs the kick: one that is sending looks at the queue again before it parks
        if self._parked and self._kick is not None:
            self._kick.send(b"", zmq.NOBLOCK)
            self._parked = False

    def _stop(self, timeout: float) -> None:
        if self._kick is not None:
            self._kick.send(b"", zmq.NOBLOCK)
        stop_threads(self._threads, self._ctx, [self._kick], timeout, "TcpChunkWriter")

    def _io_loop(self, link: zmq.Socket, kicked: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(link, zmq.POLLIN)
        poller.register(kicked, zmq.POLLIN)
        try:
            while True:
                with self._cv:
                    if self._closed:
                        return
                    batch = []
                    while self._ready_to_send_locked():
                        batch.append(self._take_locked())
                    self._parked = not batch
                if batch:  # sent outside the lock so put() never waits on the socket
                    for slot, chunk in batch:
                        link.send_multipart(_encode(slot, chunk), zmq.NOBLOCK, copy=False)
                    self._mark_written(len(batch))
                    continue
                ready = dict(poller.poll())  # no timeout: blocks until a release, a put() or close()
                if kicked in ready:
                    _discard_all(kicked)
                if link in ready:
                    self._return_slots(drain_slots(link))
        except BaseException as exc:
            self._fail("send loop", exc)
        finally:
            link.close(linger=0)
            kicked.close(linger=0)


class TcpChunkReader(ChunkReaderBase):
    """Code2wav side. One I/O thread receives chunks and sends back the slots ``release`` passes it."""

    spec: TcpSpec

    def __init__(self, spec: TcpSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(spec, condition, on_error)
        self._ctx: zmq.Context | None = None
        self._releases: zmq.Socket | None = None  # release() → the I/O thread, which owns the TCP socket
        self._wake_tx: zmq.Socket | None = None

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("TcpChunkReader already started")
        self._ctx = zmq.Context(io_threads=1)
        link = unbounded_socket(self._ctx, zmq.DEALER, self.spec.ipv6)
        try:
            link.bind(self.spec.address)
        except zmq.ZMQError:
            link.close(linger=0)
            self._ctx.term()
            raise
        self._releases, released = wake_pair(self._ctx, "tcp-releases")
        self._wake_tx, wake_rx = wake_pair(self._ctx, "tcp-reader")
        self._threads = [threading.Thread(target=self._io_loop, args=(link, released, wake_rx),
                                          name="omni-tts-tcp-recv", daemon=True)]
        self._threads[0].start()

    def _send_release_locked(self, slot: int) -> None:
        self._releases.send(SLOT_MSG.pack(slot), zmq.NOBLOCK)

    def _stop(self, timeout: float) -> None:
        if self._wake_tx is not None:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        stop_threads(self._threads, self._ctx, [self._releases, self._wake_tx], timeout, "TcpChunkReader")

    def _io_loop(self, link: zmq.Socket, released: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        for sock in (link, released, wake):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())  # no timeout: blocks until a chunk, a release or close()
                if wake in ready or released in ready:
                    self._forward_releases(link, released)
                if wake in ready:
                    link.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
                    return
                if link in ready:
                    chunks, unreadable = [], []
                    for frames in _drain_messages(link):
                        try:
                            chunks.append(_decode(frames, self.spec))
                        except (ValueError, UnicodeDecodeError) as exc:
                            logger.exception("dropping an unreadable chunk message")
                            unreadable.append((_claimed_slot(frames, self.spec.num_slots), exc))
                    if unreadable:
                        self._refuse(unreadable)
                    self._hand_over(chunks)
        except BaseException as exc:
            self._fail("recv loop", exc)
        finally:
            link.close()
            released.close(linger=0)
            wake.close(linger=0)

    @staticmethod
    def _forward_releases(link: zmq.Socket, released: zmq.Socket) -> None:
        for slot in drain_slots(released):
            try:
                link.send(SLOT_MSG.pack(slot), zmq.NOBLOCK)
            except zmq.Again:  # no peer: the writer is gone, and its slots with it
                logger.warning("no writer to release slot %d to", slot)
