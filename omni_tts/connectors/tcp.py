"""TCP chunk connector: the talker → code2wav edge over one pyzmq TCP connection, so code2wav can run on another host.

Who does what
-------------
* The **owner** (the orchestrator) calls :meth:`TcpOwner.create` at start-up and passes ``owner.spec`` (a msgspec
  :class:`TcpSpec`, with the pipeline's secret) to both stages in their launch message. Given port 0 it picks a
  free port and holds it until :meth:`TcpOwner.close` (a bound, not listening socket with SO_REUSEADDR, which the
  reader's listening socket may share), so no other process takes the port before the reader binds it.
* The **reader** (code2wav process) runs :class:`TcpChunkReader`: it binds a ROUTER at ``spec.address``; one I/O
  thread turns arriving messages into :class:`SlotView` objects whose ``codes`` are zero-copy views into the received
  frame, and sends each slot that ``release`` passes it over an inproc pipe (a zmq socket belongs to one thread)
  back to the connection its chunk came in on.
* The **writer** (talker process) runs :class:`TcpChunkWriter`: ``put`` only enqueues; one I/O thread connects a
  DEALER, sends queued chunks while it holds free slots (credits) and takes the slots the reader sends back.

Peers are authenticated with ZMQ CURVE: both key pairs derive from the pipeline's secret (``TcpSpec.secret``, which
the owner generates, or takes from the ``OMNI_TTS_CONNECTOR_SECRET`` environment variable so that stages started on
another host can share it). The reader's I/O thread is its context's ZAP handler and admits only the writer's key;
a peer without the secret never completes the handshake, so it can neither send a chunk nor receive a release (a
credit). The connection is encrypted as well.

A release can never be sent before the reader has a peer to send it to: it answers a chunk that came in. The writer
connects with ZMQ_IMMEDIATE off: what it sends before the reader binds waits in its queue, so either stage may start
first.

Wire format (little-endian), one two-frame message per chunk::

    frame 0: b"otc1" | slot u32 | seq i64 | put_ns i64 | num_frames u32 | flags u32 | request id (≤ 64 UTF-8 bytes)
    frame 1: payload: num_frames × num_codebooks int32, row-major

and a release is the slot index alone (u32). At most ``num_slots`` chunks are in flight, as in the shared-memory ring,
so memory on both ends stays bounded the same way. ``put_ns`` is the writer host's monotonic clock; the put → get
latency the reader derives from it is meaningful only while both stages share a host.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Callable

import msgspec
import numpy as np
import zmq
from zmq.utils import z85

from omni_tts.connectors.base import (MAX_REQUEST_ID_BYTES, SLOT_MSG, ChunkReaderBase, ChunkWriterBase, SlotView,
                                      QueuedChunk, connect, drain_slots, stop_threads, unbounded_socket, wake_pair)

logger = logging.getLogger(__name__)

_MAGIC = b"otc1"  # names the format: a peer of another version is refused, not misread
_HEADER = struct.Struct("<4sIqqII")  # magic, slot, seq, put time (CLOCK_MONOTONIC ns), num_frames, flags; id follows
_CLOSE_LINGER_MS = 100  # the reader's close() still delivers the releases already made, if the writer takes them
SECRET_ENV = "OMNI_TTS_CONNECTOR_SECRET"  # the pipeline's secret when set (the same on every host), else generated
_MIN_SECRET_CHARS = 32
_ZAP_ADDRESS = "inproc://zeromq.zap.01"  # where libzmq asks its context's handler about each handshake


class TcpSpec(msgspec.Struct, frozen=True, tag="tcp"):
    """Everything a stage process needs to join one TCP connector; msgspec-serializable."""

    host: str  # an IP address of the reader's host: the reader binds it, the writer connects to it
    port: int
    num_slots: int  # chunks in flight: the writer's credits
    max_frames: int
    num_codebooks: int
    secret: str  # both CURVE key pairs derive from it (curve_keys); whoever knows it may join

    def __repr__(self) -> str:  # a spec may be logged: never with its secret
        return (f"TcpSpec(host={self.host!r}, port={self.port}, num_slots={self.num_slots}, "
                f"max_frames={self.max_frames}, num_codebooks={self.num_codebooks})")

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
        this host). The secret is ``$OMNI_TTS_CONNECTOR_SECRET`` when set, else a new random one."""
        if num_slots < 1 or max_frames < 1 or num_codebooks < 1:
            raise ValueError("num_slots, max_frames and num_codebooks must be >= 1")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if not zmq.has("curve"):
            raise RuntimeError("the tcp connector needs a libzmq built with CURVE (pyzmq's wheels are)")
        secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)
        if len(secret) < _MIN_SECRET_CHARS:
            raise ValueError(f"{SECRET_ENV}: at least {_MIN_SECRET_CHARS} characters, got {len(secret)}")
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
        spec = TcpSpec(host=host, port=port, num_slots=num_slots, max_frames=max_frames, num_codebooks=num_codebooks,
                       secret=secret)
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


def curve_keys(secret: str, role: str) -> tuple[bytes, bytes]:
    """The CURVE key pair (public, secret; Z85) of `role` ("reader" or "writer") in the pipeline keyed by `secret`:
    both ends derive both pairs, so one secret is all a stage needs."""
    secret_key = z85.encode(hashlib.sha256(f"omni-tts connector {role}\0{secret}".encode()).digest())
    return zmq.curve_public(secret_key), secret_key


def writer_socket(ctx: zmq.Context, spec: TcpSpec) -> zmq.Socket:
    """The writer's DEALER, authenticated with the spec's secret and connected to the reader's address."""
    sock = unbounded_socket(ctx, zmq.DEALER, spec.ipv6)
    sock.curve_publickey, sock.curve_secretkey = curve_keys(spec.secret, "writer")
    sock.curve_serverkey = curve_keys(spec.secret, "reader")[0]
    return connect(sock, spec.address)


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


def _decode(frames: list[zmq.Frame], spec: TcpSpec) -> SlotView:
    """A received message as a SlotView viewing its payload frame; ValueError (UnicodeDecodeError for the id) for
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
    return SlotView.from_wire(raw_id, seq, put_ns, codes, flags, slot)


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
    queueing (``stats().pending``).
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
        link = writer_socket(self._ctx, self.spec)
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
            _wake(self._kick)
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
        self._refused = 0  # handshakes refused (the I/O thread's)

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("TcpChunkReader already started")
        self._ctx = zmq.Context(io_threads=1)
        # the ZAP handler is bound before the listener, so no handshake is ever answered without it
        zap = unbounded_socket(self._ctx, zmq.REP)
        zap.bind(_ZAP_ADDRESS)
        link = unbounded_socket(self._ctx, zmq.ROUTER, self.spec.ipv6)
        link.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a release to a connection that is gone raises, not vanishes
        link.curve_server = True
        link.curve_secretkey = curve_keys(self.spec.secret, "reader")[1]
        link.zap_domain = b"omni-tts-connector"
        try:
            link.bind(self.spec.address)
        except zmq.ZMQError:
            link.close(linger=0)
            zap.close(linger=0)
            self._ctx.term()
            raise
        self._releases, released = wake_pair(self._ctx, "tcp-releases")
        self._wake_tx, wake_rx = wake_pair(self._ctx, "tcp-reader")
        self._threads = [threading.Thread(target=self._io_loop, args=(link, zap, released, wake_rx),
                                          name="omni-tts-tcp-recv", daemon=True)]
        self._threads[0].start()

    def _send_release_locked(self, slot: int) -> None:
        self._releases.send(SLOT_MSG.pack(slot), zmq.NOBLOCK)

    def _stop(self, timeout: float) -> None:
        if self._wake_tx is not None:
            _wake(self._wake_tx)
        stop_threads(self._threads, self._ctx, [self._releases, self._wake_tx], timeout, "TcpChunkReader")

    def _io_loop(self, link: zmq.Socket, zap: zmq.Socket, released: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        for sock in (link, zap, released, wake):
            poller.register(sock, zmq.POLLIN)
        writer_key = z85.decode(curve_keys(self.spec.secret, "writer")[0])
        senders: dict[int, bytes] = {}  # slot -> the connection its chunk came in on, where its release goes
        try:
            while True:
                ready = dict(poller.poll())  # no timeout: blocks until a chunk, a release, a handshake or close()
                if zap in ready:
                    self._answer_handshakes(zap, writer_key)
                if wake in ready or released in ready:
                    _forward_releases(link, released, senders)
                if wake in ready:
                    link.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
                    return
                if link in ready:
                    chunks, unreadable = [], []
                    for sender, *frames in _drain_messages(link):
                        slot = _claimed_slot(frames, self.spec.num_slots)
                        if slot is not None:
                            senders.setdefault(slot, sender.bytes)  # a second claim on a held slot is ignored
                        try:
                            chunks.append(_decode(frames, self.spec))
                        except (ValueError, UnicodeDecodeError) as exc:
                            logger.exception("dropping an unreadable chunk message")
                            unreadable.append((slot, exc))
                    if unreadable:
                        self._refuse(unreadable)
                    self._hand_over(chunks)
        except BaseException as exc:
            self._fail("recv loop", exc)
        finally:
            link.close()
            for sock in (zap, released, wake):
                sock.close(linger=0)


    def _answer_handshakes(self, zap: zmq.Socket, writer_key: bytes) -> None:
        """Answer libzmq's ZAP requests (RFC 27): a CURVE handshake passes with the writer's public key only."""
        while True:
            try:
                version, request_id, _domain, address, _identity, mechanism, *credentials = zap.recv_multipart(
                    zmq.NOBLOCK)
            except zmq.Again:
                return
            allowed = mechanism == b"CURVE" and credentials == [writer_key]
            if not allowed:
                # a stray peer retries at every reconnect interval: warn once, the rest at debug level
                log = logger.debug if self._refused else logger.warning
                log("refused a connector peer at %s: it does not hold the pipeline's secret", address.decode())
                self._refused += 1
            zap.send_multipart([version, request_id, b"200" if allowed else b"400",
                                b"OK" if allowed else b"not the writer", b"writer" if allowed else b"", b""])


def _forward_releases(link: zmq.Socket, released: zmq.Socket, senders: dict[int, bytes]) -> None:
    for slot in drain_slots(released):
        sender = senders.pop(slot, None)
        try:
            if sender is not None:
                link.send_multipart([sender, SLOT_MSG.pack(slot)], zmq.NOBLOCK)
                continue
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
        logger.warning("no writer to release slot %d to: the connection it came on is gone", slot)


def _wake(sock: zmq.Socket) -> None:
    """Wake the I/O thread blocked in poll. One that saw the close first has returned and closed its end of the
    pair: the send has nowhere to go (zmq.Again), and there is nothing to wake."""
    try:
        sock.send(b"", zmq.NOBLOCK)
    except zmq.Again:
        pass
