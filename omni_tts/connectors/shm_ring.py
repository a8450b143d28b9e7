"""Shared-memory chunk connector: one ring per stage edge (talker → code2wav).

Who does what
-------------
* The **owner** (the orchestrator, parent of both stage processes) calls
  :func:`cleanup_stale_segments` and :meth:`RingOwner.create` once at start-up, passes
  ``owner.spec`` (a msgspec :class:`RingSpec`) to the two stage processes, and calls
  :meth:`RingOwner.close` on shutdown. Only the owner ever creates or unlinks the segment;
  nothing is created or unlinked per chunk.
* The **writer** (talker process) runs :class:`ChunkWriter`: ``put`` only enqueues; a save
  thread copies each chunk into a free slot and sends the slot index over pyzmq.
* The **reader** (code2wav process) runs :class:`ChunkReader`: a recv thread turns slot
  notifications into :class:`Chunk` objects whose ``codes`` are zero-copy views into the
  slot; ``release`` hands the slot back to the writer over a second pyzmq socket.

Sockets: **each side binds the socket it receives on** (the reader binds
``notify_address``, the writer binds ``release_address``) and connects the one it sends
on. The owner only picks the ``ipc://`` paths (in a private per-owner temp dir), so the
spec exists before either stage starts, and either stage may start first: a connecting
PUSH socket queues messages until the peer binds (ZMQ_IMMEDIATE is off), so nothing sent
early is lost. Each endpoint file belongs to exactly one process.

Slot layout (``RingSpec.slot_bytes`` each, 64-byte aligned)::

    [0, 128)   header: seq i64 | num_frames u32 | flags u32 | id_len u16 | request id (≤ 64 UTF-8 bytes)
    [128, …)   payload: max_frames × num_codebooks int32, row-major, first num_frames rows valid

A slot is owned by the writer while free, and by the reader from the notification until
``release``; the pyzmq message is the hand-over, so no lock lives in shared memory.
Threads block on ``threading.Condition`` / ``zmq.Poller`` with no timeout: idle CPU is ~0.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import re
import secrets
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Callable

import _posixshmem  # the POSIX shm_open behind multiprocessing.shared_memory; lets us attach untracked
import msgspec
import numpy as np
import zmq

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "omni_tts_"
SHM_DIR = "/dev/shm"
MAX_REQUEST_ID_BYTES = 64
FLAG_IS_LAST = 1
FLAG_IS_CONTEXT = 2

_HEADER = struct.Struct("<qqIIH64s")  # seq, put time (CLOCK_MONOTONIC ns), num_frames, flags, id_len, id
HEADER_BYTES = 128  # header padded so every payload starts on a cache-line boundary
_ALIGN = 64
_SLOT_MSG = struct.Struct("<I")  # the whole pyzmq message: one slot index
_OWNED_NAME = re.compile(rf"^{SEGMENT_PREFIX}(\d+)_")
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; stay clear of it


class RingSpec(msgspec.Struct, frozen=True):
    """Everything a stage process needs to attach to one ring; msgspec-serializable."""

    name: str  # shared-memory segment name, "omni_tts_<owner pid>_..."
    num_slots: int
    max_frames: int
    num_codebooks: int
    notify_address: str  # writer → reader slot notifications; bound by the reader
    release_address: str  # reader → writer slot releases; bound by the writer

    @property
    def slot_bytes(self) -> int:
        raw = HEADER_BYTES + self.max_frames * self.num_codebooks * 4
        return -(-raw // _ALIGN) * _ALIGN

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """One chunk as seen by the reader.

    ``codes`` is a read-only zero-copy view [num_frames, num_codebooks] int32 into the ring
    slot. It is valid only until ``ChunkReader.release(chunk)``: after that the writer may
    overwrite the slot, so copy (``codes.copy()``) whatever must outlive the release.
    """

    request_id: str
    seq: int
    put_ns: int  # when the writer's put() was called (time.monotonic_ns(): one clock for all processes)
    codes: np.ndarray
    is_last: bool
    is_context: bool
    slot: int


@dataclass(frozen=True, slots=True)
class WriterStats:
    chunks_put: int
    chunks_written: int
    slots_in_use: int  # written and not yet released by the reader
    pending: int  # put() but not yet in a slot
    max_queued: int  # high-water mark of `pending`
    slot_stalls: int  # times the save loop had to wait for the reader to free a slot


@dataclass(frozen=True, slots=True)
class ReaderStats:
    chunks_received: int
    queued: int  # received, not yet taken by get()
    slots_held: int  # received, not yet released


# ---------------------------------------------------------------------------- owner side


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # never ours to judge; os.kill(0, …) would address our process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to another user
    return True


def cleanup_stale_segments(shm_dir: str = SHM_DIR, ipc_root: str | None = None) -> list[str]:
    """Remove ``omni_tts_<pid>_*`` segments (and ipc temp dirs) left by owners that died.

    Called by the owner at start-up, before creating its rings, so a crashed server (e.g.
    SIGKILL, where no shutdown path ran) does not leak /dev/shm across restarts. Entries of
    live pids, including other servers on this host, are kept. Returns the removed paths.
    """
    removed: list[str] = []
    for directory, want_dir in ((shm_dir, False), (ipc_root or tempfile.gettempdir(), True)):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in names:
            match = _OWNED_NAME.match(name)
            if match is None or _pid_alive(int(match.group(1))):
                continue
            path = os.path.join(directory, name)
            try:
                if want_dir != os.path.isdir(path):
                    continue
                if want_dir:
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                continue  # another server's start-up reaped it first
            except OSError as exc:
                logger.warning("cannot remove stale %s: %s", path, exc)
                continue
            removed.append(path)
    if removed:
        logger.info("removed %d stale omni_tts shared-memory entries", len(removed))
    return removed


class RingOwner:
    """Creates one ring (segment + ipc dir) at start-up and unlinks it on shutdown."""

    def __init__(self, spec: RingSpec, shm: shared_memory.SharedMemory, ipc_dir: str) -> None:
        self.spec = spec
        self._shm: shared_memory.SharedMemory | None = shm
        self._ipc_dir = ipc_dir

    @classmethod
    def create(cls, num_slots: int, max_frames: int, num_codebooks: int = 16, edge: str = "ring") -> RingOwner:
        if num_slots < 1 or max_frames < 1 or num_codebooks < 1:
            raise ValueError("num_slots, max_frames and num_codebooks must be >= 1")
        if not re.fullmatch(r"[A-Za-z0-9]+", edge):
            raise ValueError(f"edge must be alphanumeric, got {edge!r}")
        pid = os.getpid()
        # mkdtemp: unique per owner, mode 0700, so two servers on one host never share endpoints.
        ipc_dir = tempfile.mkdtemp(prefix=f"{SEGMENT_PREFIX}{pid}_")
        spec = RingSpec(
            name=f"{SEGMENT_PREFIX}{pid}_{edge}_{secrets.token_hex(4)}",
            num_slots=num_slots, max_frames=max_frames, num_codebooks=num_codebooks,
            notify_address=f"ipc://{ipc_dir}/{edge}.notify", release_address=f"ipc://{ipc_dir}/{edge}.release")
        if len(spec.release_address) - len("ipc://") > _MAX_IPC_PATH:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise ValueError(f"ipc path too long for a unix socket ({ipc_dir}); set a shorter TMPDIR")
        try:
            # The owner keeps the resource-tracker registration on purpose: if the owner is
            # killed, its tracker still unlinks the segment (cleanup_stale_segments is the
            # second net, for when the tracker dies too).
            shm = shared_memory.SharedMemory(name=spec.name, create=True, size=spec.total_bytes)
        except BaseException:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        shm.close()  # the owner never touches slots; unlink needs only the name
        return cls(spec, shm, ipc_dir)

    def close(self) -> None:
        """Unlink the segment and remove the ipc dir; safe to call twice. Stages may still
        have it mapped: the memory lives until their last mapping goes away."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            shm.unlink()
        except FileNotFoundError:  # removed behind our back; still drop the tracker entry
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> RingOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- stage side


class _Ring:
    """A stage process's mapping of the ring.

    Attaching goes through ``_posixshmem.shm_open`` + ``mmap`` instead of
    ``SharedMemory(name)``: on Python 3.11/3.12 the latter registers the segment with the
    attaching process's resource tracker, which unlinks it (and warns) when that process
    exits, taking the ring away from the owner and the other stage.
    """

    def __init__(self, spec: RingSpec, writable_payload: bool) -> None:
        self.spec = spec
        fd = _posixshmem.shm_open("/" + spec.name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < spec.total_bytes:
                raise ValueError(f"segment {spec.name} has {size} bytes, spec needs {spec.total_bytes}")
            self._mm: mmap.mmap | None = mmap.mmap(fd, spec.total_bytes)
        finally:
            os.close(fd)  # the mapping keeps the memory; the fd is not needed
        items = spec.max_frames * spec.num_codebooks
        self.payloads: list[np.ndarray] = []
        for slot in range(spec.num_slots):
            view = np.frombuffer(self._mm, np.int32, items, slot * spec.slot_bytes + HEADER_BYTES)
            view = view.reshape(spec.max_frames, spec.num_codebooks)
            view.flags.writeable = writable_payload  # the reader must never scribble on a slot
            self.payloads.append(view)

    def write(self, slot: int, request_id: bytes, seq: int, put_ns: int, codes: np.ndarray, flags: int) -> None:
        frames = codes.shape[0]
        self.payloads[slot][:frames] = codes
        _HEADER.pack_into(self._mm, slot * self.spec.slot_bytes, seq, put_ns, frames, flags, len(request_id),
                          request_id)

    def read(self, slot: int) -> Chunk:
        seq, put_ns, frames, flags, id_len, raw_id = _HEADER.unpack_from(self._mm, slot * self.spec.slot_bytes)
        if frames > self.spec.max_frames or id_len > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"corrupt header in slot {slot}: frames={frames} id_len={id_len}")
        return Chunk(request_id=raw_id[:id_len].decode(), seq=seq, put_ns=put_ns, codes=self.payloads[slot][:frames],
                     is_last=bool(flags & FLAG_IS_LAST), is_context=bool(flags & FLAG_IS_CONTEXT), slot=slot)

    def close(self) -> None:
        self.payloads = []
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # a consumer still holds Chunk views; the mapping is freed with the last one


def _connect(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A PUSH socket connected to the peer's bound address (which may not exist yet)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)  # a dead peer must never make close() hang
    sock.setsockopt(zmq.SNDHWM, 0)  # in-flight messages are bounded by num_slots anyway
    # If we start before the peer binds, the first chunks wait for a reconnect: retry after
    # 10 ms instead of the default 100 ms, backing off to 1 s so a dead peer costs nothing.
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(address)
    return sock


def _wake_pair(ctx: zmq.Context, tag: str) -> tuple[zmq.Socket, zmq.Socket]:
    """An inproc PAIR so close() can wake a thread blocked in zmq.Poller.poll() without timeouts."""
    addr = f"inproc://omni-tts-wake-{tag}-{secrets.token_hex(4)}"
    rx = ctx.socket(zmq.PAIR)
    rx.bind(addr)
    tx = ctx.socket(zmq.PAIR)
    tx.connect(addr)
    return tx, rx


def _drain_slots(sock: zmq.Socket) -> list[int]:
    """Every slot index already queued on `sock` (called after poll said it is readable)."""
    slots = []
    while True:
        try:
            msg = sock.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return slots
        if len(msg) == _SLOT_MSG.size:
            slots.append(_SLOT_MSG.unpack(msg)[0])
        else:
            logger.warning("dropping malformed connector message of %d bytes", len(msg))


def _join(threads: list[threading.Thread], timeout: float) -> bool:
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


class ChunkWriter:
    """Talker side. ``put`` never blocks; a save thread moves chunks into slots in put order.

    When every slot is held by the reader, the save thread waits on the Condition until a
    release arrives (back-pressure) while ``put`` keeps queueing; watch ``pending()`` to
    throttle the engine if the queue grows.
    """

    def __init__(self, spec: RingSpec, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.spec = spec
        self._on_error = on_error
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[bytes, int, int, np.ndarray, int]] = collections.deque()
        self._free: collections.deque[int] = collections.deque(range(spec.num_slots))
        self._in_use: set[int] = set()
        self._closed = False
        self._error: BaseException | None = None
        self._put = self._written = self._max_queued = self._stalls = 0
        self._ring: _Ring | None = None
        self._ctx: zmq.Context | None = None
        self._wake_tx: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("ChunkWriter already started")
        self._ring = _Ring(self.spec, writable_payload=True)
        self._ctx = zmq.Context(io_threads=1)
        notify = _connect(self._ctx, self.spec.notify_address)
        release = self._ctx.socket(zmq.PULL)
        release.setsockopt(zmq.LINGER, 0)
        release.bind(self.spec.release_address)
        self._wake_tx, wake_rx = _wake_pair(self._ctx, "writer")
        self._threads = [
            threading.Thread(target=self._save_loop, args=(notify,), name="omni-tts-shm-save", daemon=True),
            threading.Thread(target=self._release_loop, args=(release, wake_rx), name="omni-tts-shm-release",
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    def put(self, request_id: str, seq: int, codes: np.ndarray, is_last: bool, is_context: bool = False) -> None:
        """Queue one chunk ([F, num_codebooks] integer codes, 0 ≤ F ≤ max_frames; F = 0 is
        allowed for a bare end-of-request marker). Copies ``codes``, so the caller may reuse
        its buffer at once. Returns immediately; raises on bad input or a closed writer."""
        rid = request_id.encode()
        if len(rid) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request id longer than {MAX_REQUEST_ID_BYTES} UTF-8 bytes: {request_id!r}")
        if codes.ndim != 2 or codes.shape[1] != self.spec.num_codebooks or codes.shape[0] > self.spec.max_frames:
            raise ValueError(f"codes must be [F<={self.spec.max_frames}, {self.spec.num_codebooks}], "
                             f"got {codes.shape}")
        if not np.issubdtype(codes.dtype, np.integer):
            raise TypeError(f"codes must be integers, got {codes.dtype}")
        item = (rid, seq, time.monotonic_ns(), np.array(codes, dtype=np.int32, copy=True),
                (FLAG_IS_LAST if is_last else 0) | (FLAG_IS_CONTEXT if is_context else 0))
        with self._cv:
            if self._closed or self._error is not None:
                raise RuntimeError("ChunkWriter is closed") from self._error
            self._queue.append(item)
            self._put += 1
            self._max_queued = max(self._max_queued, len(self._queue))
            self._cv.notify_all()

    def pending(self) -> int:
        """Chunks put but not yet written into a slot (the engine's throttling signal)."""
        with self._cv:
            return len(self._queue)

    def stats(self) -> WriterStats:
        with self._cv:
            return WriterStats(chunks_put=self._put, chunks_written=self._written, slots_in_use=len(self._in_use),
                               pending=len(self._queue), max_queued=self._max_queued, slot_stalls=self._stalls)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk put so far has been written and announced; False on timeout."""
        with self._cv:
            target = self._put
            return self._cv.wait_for(lambda: self._written >= target or self._closed or self._error is not None,
                                     timeout) and self._written >= target

    def close(self, timeout: float = 2.0) -> None:
        """Stop both threads and unmap; chunks not yet in a slot are dropped. Idempotent, and
        prompt even if the reader is dead (the save thread waits on the Condition, the
        release thread is woken through its inproc pair, sockets have LINGER 0)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if dropped:
            logger.info("ChunkWriter closed with %d unsent chunks", dropped)
        if self._wake_tx is not None:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        _close_stage(self._threads, self._wake_tx, self._ctx, self._ring, timeout, "ChunkWriter")

    def __enter__(self) -> ChunkWriter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_loop(self, notify: zmq.Socket) -> None:
        try:
            while True:
                with self._cv:
                    stalled = False
                    while not self._closed and not (self._queue and self._free):
                        if self._queue and not stalled:  # work waiting, every slot held: back-pressure
                            stalled = True
                            self._stalls += 1
                        self._cv.wait()
                    if self._closed:
                        return
                    rid, seq, put_ns, codes, flags = self._queue.popleft()
                    slot = self._free.popleft()
                    self._in_use.add(slot)
                # Copy and notify outside the lock so put() and releases never wait on it.
                self._ring.write(slot, rid, seq, put_ns, codes, flags)
                notify.send(_SLOT_MSG.pack(slot), zmq.NOBLOCK)
                with self._cv:
                    self._written += 1
                    self._cv.notify_all()  # flush() waiters
        except BaseException as exc:  # surface to put()/flush() and the owner instead of dying silently
            logger.exception("connector save loop failed")
            with self._cv:
                self._error = exc
                self._cv.notify_all()
            _report(self._on_error, exc)
        finally:
            notify.close(linger=0)

    def _release_loop(self, release: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(release, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())  # no timeout: blocks until a release or close()
                if wake in ready:
                    return
                slots = _drain_slots(release)
                with self._cv:
                    for slot in slots:
                        if slot in self._in_use:
                            self._in_use.discard(slot)
                            self._free.append(slot)
                        else:  # never free a slot twice: it would be handed out twice
                            logger.warning("ignoring release of slot %d that is not in use", slot)
                    self._cv.notify_all()
        except BaseException as exc:
            logger.exception("connector release loop failed")
            _report(self._on_error, exc)
        finally:
            release.close(linger=0)
            wake.close(linger=0)


class ChunkReader:
    """Code2wav side. A recv thread turns slot notifications into :class:`Chunk` objects.

    The consumer waits with ``get`` / ``get_all_nowait`` and must ``release`` every chunk
    once it no longer needs ``chunk.codes``. Pass ``condition`` to share one Condition with
    other event sources of the engine loop (it is notified on every arrival).
    """

    def __init__(self, spec: RingSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.spec = spec
        self._on_error = on_error
        self._cv = condition or threading.Condition()
        self._queue: collections.deque[Chunk] = collections.deque()
        self._held: dict[int, Chunk] = {}  # slot -> the chunk currently occupying it
        self._received = 0
        self._closed = False
        self._ring: _Ring | None = None
        self._ctx: zmq.Context | None = None
        self._release_sock: zmq.Socket | None = None
        self._wake_tx: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("ChunkReader already started")
        self._ring = _Ring(self.spec, writable_payload=False)
        self._ctx = zmq.Context(io_threads=1)
        notify = self._ctx.socket(zmq.PULL)
        notify.setsockopt(zmq.LINGER, 0)
        notify.bind(self.spec.notify_address)
        self._release_sock = _connect(self._ctx, self.spec.release_address)
        self._wake_tx, wake_rx = _wake_pair(self._ctx, "reader")
        self._threads = [threading.Thread(target=self._recv_loop, args=(notify, wake_rx), name="omni-tts-shm-recv",
                                          daemon=True)]
        self._threads[0].start()

    def get(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk, waiting up to `timeout` seconds (None: forever); None on timeout or close."""
        with self._cv:
            self._cv.wait_for(lambda: self._queue or self._closed, timeout)
            return self._queue.popleft() if self._queue else None

    def get_all_nowait(self) -> list[Chunk]:
        """Every chunk received so far, in arrival order (per request: seq order)."""
        with self._cv:
            chunks = list(self._queue)
            self._queue.clear()
            return chunks

    def release(self, chunk: Chunk) -> None:
        """Give the chunk's slot back to the writer; ``chunk.codes`` is invalid afterwards.
        Releasing a chunk twice raises ValueError (it would free a slot another chunk uses)."""
        with self._cv:
            if self._held.get(chunk.slot) is not chunk:
                raise ValueError(f"chunk {chunk.request_id}#{chunk.seq} (slot {chunk.slot}) is not held")
            del self._held[chunk.slot]
            if self._closed:
                return
            # Sent under the lock: zmq sockets are not thread-safe and release() may be
            # called from any consumer thread. NOBLOCK cannot fail: SNDHWM is unlimited.
            self._release_sock.send(_SLOT_MSG.pack(chunk.slot), zmq.NOBLOCK)

    def stats(self) -> ReaderStats:
        with self._cv:
            return ReaderStats(chunks_received=self._received, queued=len(self._queue), slots_held=len(self._held))

    def close(self, timeout: float = 2.0) -> None:
        """Stop the recv thread and unmap; idempotent. Chunk views still held by the caller
        keep the mapping alive until they are dropped."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            release_sock, self._release_sock = self._release_sock, None
        if release_sock is not None:
            release_sock.close(linger=0)
        if self._wake_tx is not None:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        _close_stage(self._threads, self._wake_tx, self._ctx, self._ring, timeout, "ChunkReader")

    def __enter__(self) -> ChunkReader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv_loop(self, notify: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(notify, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())  # no timeout: blocks until a notification or close()
                if wake in ready:
                    return
                chunks, unreadable = [], []
                for slot in _drain_slots(notify):
                    if not 0 <= slot < self.spec.num_slots:
                        logger.warning("ignoring notification for slot %d out of range", slot)
                        continue
                    try:
                        chunks.append(self._ring.read(slot))
                    except (ValueError, UnicodeDecodeError) as exc:  # a writer bug; never hand garbage on
                        logger.exception("dropping unreadable chunk in slot %d", slot)
                        unreadable.append((slot, exc))
                if unreadable:
                    with self._cv:  # the writer gets its slots back; the chunk's request is lost: the owner must know
                        for slot, _ in unreadable:
                            if not self._closed:
                                self._release_sock.send(_SLOT_MSG.pack(slot), zmq.NOBLOCK)
                    _report(self._on_error, unreadable[0][1])
                with self._cv:
                    for chunk in chunks:
                        if chunk.slot in self._held:  # protocol violation: keep the first holder
                            logger.warning("ignoring notification for slot %d that is still held", chunk.slot)
                            continue
                        self._held[chunk.slot] = chunk
                        self._queue.append(chunk)
                        self._received += 1
                    self._cv.notify_all()
        except BaseException as exc:
            logger.exception("connector recv loop failed")
            _report(self._on_error, exc)
        finally:
            notify.close(linger=0)
            wake.close(linger=0)


def _report(on_error: Callable[[BaseException], None] | None, exc: BaseException) -> None:
    if on_error is not None:
        on_error(exc)


def _close_stage(threads: list[threading.Thread], wake_tx: zmq.Socket | None, ctx: zmq.Context | None,
                 ring: _Ring | None, timeout: float, what: str) -> None:
    """Shared tail of the stage-side close(): join, then release zmq and the mapping."""
    stopped = _join(threads, timeout)
    if wake_tx is not None:
        wake_tx.close(linger=0)
    if not stopped:
        # Unmapping or terminating the context under a live thread could crash or hang.
        logger.error("%s threads did not stop within %.1fs; leaving them (daemon)", what, timeout)
        return
    if ctx is not None:
        ctx.term()
    if ring is not None:
        ring.close()
