"""Shared-memory chunk connector: one ring per stage edge (talker → code2wav).

Who does what
-------------
* The **owner** (the orchestrator, parent of both stage processes) calls
  :func:`cleanup_stale_blocks` and :meth:`RingOwner.create` once at start-up, passes
  ``owner.spec`` (a msgspec :class:`RingSpec`) to the two stage processes, and calls
  :meth:`RingOwner.close` on shutdown. Only the owner ever creates or unlinks the block;
  nothing is created or unlinked per chunk. No process registers the block with Python's
  resource tracker: a killed owner's block is removed by its stages, which see their parent
  gone (``stages/common.py``), and by the next owner's :func:`cleanup_stale_blocks`; a
  tracker would only race them and warn of a "leaked" block at the owner's death.
* The **writer** (talker process) runs :class:`ChunkWriter`: ``put`` only enqueues; a save
  thread copies each chunk into a free slot and sends the slot index over pyzmq.
* The **reader** (code2wav process) runs :class:`ChunkReader`: a recv thread turns slot
  notifications into :class:`SlotView` objects whose ``codes`` are zero-copy views into the
  slot; ``release`` hands the slot back to the writer over a second pyzmq socket.

Sockets: **each side binds the socket it receives on** (the reader binds
``notify_address``, the writer binds ``release_address``) and connects the one it sends
on. The owner only picks the ``ipc://`` paths (in a private per-owner temp dir), so the
spec exists before either stage starts, and either stage may start first: a connecting
PUSH socket queues messages until the peer binds (ZMQ_IMMEDIATE is off), so nothing sent
early is lost. Each endpoint file belongs to exactly one process.

Slot layout (``RingSpec.slot_bytes`` each, 64-byte aligned)::

    [0, 128)   header: seq i64 | put_ns i64 | num_frames u32 | flags u32 | id_len u16 | request id (≤ 64 UTF-8 bytes)
    [128, …)   payload: max_frames × num_codebooks int32, row-major, first num_frames rows valid

A slot is owned by the writer while free, and by the reader from the notification until
``release``; the pyzmq message is the hand-over, so no lock lives in shared memory. The slot
bookkeeping, :class:`SlotView` and the stats are every kind's (``base.py``); ``tcp.py`` is the
kind for a code2wav on another host.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import shutil
import struct
import tempfile
import threading
from typing import Callable

import _posixshmem  # the POSIX shm_open behind multiprocessing.shared_memory, without its resource tracker
import msgspec
import numpy as np
import zmq

from omni_tts.connectors.base import (MAX_REQUEST_ID_BYTES, SLOT_MSG, ChunkReaderBase, ChunkWriterBase, SlotView,
                                      connect, drain_slots, stop_threads, unbounded_socket, wake_pair)

logger = logging.getLogger(__name__)

BLOCK_PREFIX = "omni_tts_"
SHM_DIR = "/dev/shm"
_HEADER = struct.Struct("<qqIIH64s")  # seq, put time (CLOCK_MONOTONIC ns), num_frames, flags, id_len, id
HEADER_BYTES = 128  # header padded so every payload starts on a cache-line boundary
_ALIGN = 64
_OWNED_NAME = re.compile(rf"^{BLOCK_PREFIX}(\d+)_")
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; stay clear of it


class RingSpec(msgspec.Struct, frozen=True, tag="shm"):
    """Everything a stage process needs to attach to one ring; msgspec-serializable."""

    name: str  # shared-memory block name, "omni_tts_<owner pid>_..."
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
    try:  # a zombie (killed, not yet reaped by its parent) answers kill(pid, 0) but owns nothing any more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def cleanup_stale_blocks(shm_dir: str = SHM_DIR, ipc_root: str | None = None) -> list[str]:
    """Remove ``omni_tts_<pid>_*`` blocks (and ipc temp dirs) left by owners that died.

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
    """Creates one ring (block + ipc dir) at start-up and unlinks it on shutdown."""

    def __init__(self, spec: RingSpec, ipc_dir: str) -> None:
        self.spec = spec
        self._ipc_dir: str | None = ipc_dir   # None once closed

    @classmethod
    def create(cls, num_slots: int, max_frames: int, num_codebooks: int = 16, edge: str = "ring") -> RingOwner:
        if num_slots < 1 or max_frames < 1 or num_codebooks < 1:
            raise ValueError("num_slots, max_frames and num_codebooks must be >= 1")
        if not re.fullmatch(r"[A-Za-z0-9]+", edge):
            raise ValueError(f"edge must be alphanumeric, got {edge!r}")
        pid = os.getpid()
        # mkdtemp: unique per owner, mode 0700, so two servers on one host never share endpoints.
        ipc_dir = tempfile.mkdtemp(prefix=f"{BLOCK_PREFIX}{pid}_")
        spec = RingSpec(
            name=f"{BLOCK_PREFIX}{pid}_{edge}_{secrets.token_hex(4)}",
            num_slots=num_slots, max_frames=max_frames, num_codebooks=num_codebooks,
            notify_address=f"ipc://{ipc_dir}/{edge}.notify", release_address=f"ipc://{ipc_dir}/{edge}.release")
        if len(spec.release_address) - len("ipc://") > _MAX_IPC_PATH:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise ValueError(f"ipc path too long for a unix socket ({ipc_dir}); set a shorter TMPDIR")
        try:
            # the owner never maps the slots: the block is made at its size and closed
            fd = _posixshmem.shm_open("/" + spec.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            try:
                os.ftruncate(fd, spec.total_bytes)
            except BaseException:
                _posixshmem.shm_unlink("/" + spec.name)
                raise
            finally:
                os.close(fd)
        except BaseException:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        return cls(spec, ipc_dir)

    def close(self) -> None:
        """Unlink the block and remove the ipc dir; safe to call twice. Stages may still
        have it mapped: the memory lives until their last mapping goes away."""
        ipc_dir, self._ipc_dir = self._ipc_dir, None
        if ipc_dir is None:
            return
        try:
            _posixshmem.shm_unlink("/" + self.spec.name)
        except FileNotFoundError:  # removed behind our back (by a stale-block cleanup)
            pass
        shutil.rmtree(ipc_dir, ignore_errors=True)

    def __enter__(self) -> RingOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- stage side


class _Ring:
    """A stage process's mapping of the ring.

    Attaching goes through ``_posixshmem.shm_open`` + ``mmap`` instead of
    ``SharedMemory(name)``: on Python 3.11/3.12 the latter registers the block with the
    attaching process's resource tracker, which unlinks it (and warns) when that process
    exits, taking the ring away from the owner and the other stage (the owner does not
    register it either: see the module's docstring).
    """

    def __init__(self, spec: RingSpec, writable_payload: bool) -> None:
        self.spec = spec
        fd = _posixshmem.shm_open("/" + spec.name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < spec.total_bytes:
                raise ValueError(f"block {spec.name} has {size} bytes, spec needs {spec.total_bytes}")
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

    def read(self, slot: int) -> SlotView:
        seq, put_ns, frames, flags, id_len, raw_id = _HEADER.unpack_from(self._mm, slot * self.spec.slot_bytes)
        if frames > self.spec.max_frames or id_len > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"corrupt header in slot {slot}: frames={frames} id_len={id_len}")
        return SlotView.from_wire(raw_id[:id_len], seq, put_ns, self.payloads[slot][:frames], flags, slot)

    def close(self) -> None:
        self.payloads = []
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # a consumer still holds slot views; the mapping is freed with the last one


class ChunkWriter(ChunkWriterBase):
    """Talker side. ``put`` never blocks; a save thread copies chunks into free slots in put order and announces
    each slot index; a release thread frees the slots the reader hands back.

    When every slot is held by the reader, the save thread waits on the Condition until a
    release arrives (back-pressure) while ``put`` keeps queueing (``stats().pending``).
    """

    spec: RingSpec

    def __init__(self, spec: RingSpec, on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(spec, on_error)
        self._ring: _Ring | None = None
        self._ctx: zmq.Context | None = None
        self._wake_tx: zmq.Socket | None = None

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("ChunkWriter already started")
        self._ring = _Ring(self.spec, writable_payload=True)
        self._ctx = zmq.Context(io_threads=1)
        notify = connect(unbounded_socket(self._ctx, zmq.PUSH), self.spec.notify_address)
        release = unbounded_socket(self._ctx, zmq.PULL)
        release.bind(self.spec.release_address)
        self._wake_tx, wake_rx = wake_pair(self._ctx, "writer")
        self._threads = [
            threading.Thread(target=self._save_loop, args=(notify,), name="omni-tts-shm-save", daemon=True),
            threading.Thread(target=self._release_loop, args=(release, wake_rx), name="omni-tts-shm-release",
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _wake_sender_locked(self) -> None:
        self._cv.notify_all()  # the save thread waits on the Condition

    def _stop(self, timeout: float) -> None:
        if self._wake_tx is not None:
            self._wake_tx.send(b"", zmq.NOBLOCK)  # the release thread waits in zmq poll
        if stop_threads(self._threads, self._ctx, [self._wake_tx], timeout, "ChunkWriter") and self._ring:
            self._ring.close()

    def _save_loop(self, notify: zmq.Socket) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._ready_to_send_locked():
                        self._cv.wait()
                    if self._closed:
                        return
                    slot, (rid, seq, put_ns, codes, flags) = self._take_locked()
                # Copy and notify outside the lock so put() and releases never wait on it.
                self._ring.write(slot, rid, seq, put_ns, codes, flags)
                notify.send(SLOT_MSG.pack(slot), zmq.NOBLOCK)
                self._mark_written(1)
        except BaseException as exc:
            self._fail("save loop", exc)
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
                self._return_slots(drain_slots(release))
        except BaseException as exc:
            self._fail("release loop", exc)
        finally:
            release.close(linger=0)
            wake.close(linger=0)


class ChunkReader(ChunkReaderBase):
    """Code2wav side. A recv thread turns slot notifications into :class:`SlotView` objects whose ``codes`` are
    zero-copy views into the slot; ``release`` sends the slot index back over pyzmq."""

    spec: RingSpec

    def __init__(self, spec: RingSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(spec, condition, on_error)
        self._ring: _Ring | None = None
        self._ctx: zmq.Context | None = None
        self._release_sock: zmq.Socket | None = None
        self._wake_tx: zmq.Socket | None = None

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("ChunkReader already started")
        self._ring = _Ring(self.spec, writable_payload=False)
        self._ctx = zmq.Context(io_threads=1)
        notify = unbounded_socket(self._ctx, zmq.PULL)
        notify.bind(self.spec.notify_address)
        self._release_sock = connect(unbounded_socket(self._ctx, zmq.PUSH), self.spec.release_address)
        self._wake_tx, wake_rx = wake_pair(self._ctx, "reader")
        self._threads = [threading.Thread(target=self._recv_loop, args=(notify, wake_rx), name="omni-tts-shm-recv",
                                          daemon=True)]
        self._threads[0].start()

    def _send_release_locked(self, slot: int) -> None:
        # NOBLOCK cannot fail: the socket connects (its queue exists before the writer binds) and SNDHWM is unlimited
        self._release_sock.send(SLOT_MSG.pack(slot), zmq.NOBLOCK)

    def _stop(self, timeout: float) -> None:
        if self._wake_tx is not None:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        if stop_threads(self._threads, self._ctx, [self._release_sock, self._wake_tx], timeout,
                        "ChunkReader") and self._ring:
            self._ring.close()

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
                for slot in drain_slots(notify):
                    if not 0 <= slot < self.spec.num_slots:
                        logger.warning("ignoring notification for slot %d out of range", slot)
                        continue
                    try:
                        chunks.append(self._ring.read(slot))
                    except (ValueError, UnicodeDecodeError) as exc:
                        logger.exception("dropping unreadable chunk in slot %d", slot)
                        unreadable.append((slot, exc))
                if unreadable:
                    self._refuse(unreadable)
                self._hand_over(chunks)
        except BaseException as exc:
            self._fail("recv loop", exc)
        finally:
            notify.close(linger=0)
            wake.close(linger=0)
