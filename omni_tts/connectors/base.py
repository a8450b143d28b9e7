"""What every connector kind shares: the :class:`SlotView` a reader hands out, the stats, the slot bookkeeping of
both ends and the zmq thread helpers.

A connector moves chunks from one writer (talker) to one reader (code2wav) with at most ``num_slots`` chunks in
flight: the writer takes a free slot for each chunk it sends and gets it back when the reader calls ``release``.
That bound is the back-pressure: while the reader holds every slot the writer's sender waits and ``put`` keeps
queueing (``stats().pending`` counts what waits), so what crosses the connector never exceeds
``num_slots`` chunks. ``shm_ring`` keeps each slot's chunk in shared memory and sends only the slot index;
``tcp`` sends the chunk itself and the slot index is a credit.

Threads block on ``threading.Condition`` / ``zmq.Poller`` with no timeout: idle CPU is ~0.
"""

from __future__ import annotations

import collections
import logging
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import zmq

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_BYTES = 64
FLAG_IS_LAST = 1
FLAG_IS_CONTEXT = 2
SLOT_MSG = struct.Struct("<I")  # a slot notification or release: the whole pyzmq message is one slot index

# a chunk between put() and its slot: UTF-8 request id, seq, put time (ns), int32 codes [F, num_codebooks], flags
QueuedChunk = tuple[bytes, int, int, np.ndarray, int]


class SlotSpec(Protocol):
    """What both ends read from any kind's spec."""

    @property
    def num_slots(self) -> int: ...

    @property
    def max_frames(self) -> int: ...

    @property
    def num_codebooks(self) -> int: ...


@dataclass(frozen=True, slots=True, eq=False)
class SlotView:
    """A request's codec frames in one connector slot, as the reader holds them until ``release``.

    ``codes`` is a read-only zero-copy view [num_frames, num_codebooks] int32 into the slot (shm) or the received
    message (tcp). It is valid only until ``release(chunk)``: after that the writer may overwrite the slot, so copy
    (``codes.copy()``) whatever must outlive the release.
    """

    request_id: str
    seq: int
    put_ns: int  # when the writer's put() was called (time.monotonic_ns() of the writer's host)
    codes: np.ndarray
    is_last: bool
    is_context: bool
    slot: int

    @classmethod
    def from_wire(cls, raw_id: bytes, seq: int, put_ns: int, codes: np.ndarray, flags: int, slot: int) -> SlotView:
        """A chunk from the fields a writer sent; UnicodeDecodeError for an id that is not UTF-8."""
        return cls(request_id=raw_id.decode(), seq=seq, put_ns=put_ns, codes=codes, is_last=bool(flags & FLAG_IS_LAST),
                   is_context=bool(flags & FLAG_IS_CONTEXT), slot=slot)


@dataclass(frozen=True, slots=True)
class WriterStats:
    chunks_put: int
    chunks_written: int
    slots_in_use: int  # written and not yet released by the reader
    pending: int  # put() but not yet in a slot
    max_queued: int  # high-water mark of `pending`
    slot_stalls: int  # times the sender had to wait for the reader to free a slot
    stalled_seconds: float = 0.0  # how long the current stall (every slot held, chunks waiting) has lasted


@dataclass(frozen=True, slots=True)
class ReaderStats:
    chunks_received: int
    queued: int  # received, not yet taken by get()
    slots_held: int  # received, not yet released


class ChunkWriterBase:
    """Talker side of any kind. ``put`` never blocks; the kind's sender thread takes queued chunks in put order,
    each with a free slot (:meth:`_take_locked`), and its receiver gives released slots back (:meth:`_return_slots`).
    """

    def __init__(self, spec: SlotSpec, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.spec = spec
        self._on_error = on_error
        self._cv = threading.Condition()
        self._queue: collections.deque[QueuedChunk] = collections.deque()
        self._free: collections.deque[int] = collections.deque(range(spec.num_slots))
        self._in_use: set[int] = set()
        self._closed = False
        self._error: BaseException | None = None
        self._stalled = False  # chunks wait and every slot is held (one stall until a slot is taken again)
        self._stalled_since = 0.0  # time.monotonic() when the current stall began
        self._put = self._written = self._max_queued = self._stalls = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        raise NotImplementedError

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
                raise RuntimeError(f"{type(self).__name__} is closed") from self._error
            self._queue.append(item)
            self._put += 1
            self._max_queued = max(self._max_queued, len(self._queue))
            self._wake_sender_locked()

    def stats(self) -> WriterStats:
        with self._cv:
            return WriterStats(chunks_put=self._put, chunks_written=self._written, slots_in_use=len(self._in_use),
                               pending=len(self._queue), max_queued=self._max_queued, slot_stalls=self._stalls,
                               stalled_seconds=time.monotonic() - self._stalled_since if self._stalled else 0.0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk put so far has been written and announced; False on timeout."""
        with self._cv:
            target = self._put
            return self._cv.wait_for(lambda: self._written >= target or self._closed or self._error is not None,
                                     timeout) and self._written >= target

    def wait_released(self, timeout: float) -> bool:
        """Until every chunk put has been written, read and its slot given back; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._in_use or self._closed, timeout) and not self._in_use

    def close(self, timeout: float = 2.0) -> None:
        """Stop the threads and let go of the transport; chunks not yet in a slot are dropped. Idempotent, and
        prompt even if the reader is dead (sockets have LINGER 0, no thread waits without a wake-up)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if dropped:
            logger.info("%s closed with %d unsent chunks", type(self).__name__, dropped)
        self._stop(timeout)

    def __enter__(self) -> ChunkWriterBase:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- for the kinds ------------------------------------------------------------------------------------------
    def _wake_sender_locked(self) -> None:
        """put() queued a chunk: make the sender thread look (the caller holds the lock)."""
        raise NotImplementedError

    def _stop(self, timeout: float) -> None:
        """close() after the bookkeeping: wake and join the threads, release sockets and transport."""
        raise NotImplementedError

    def _ready_to_send_locked(self) -> bool:
        """True when a queued chunk has a free slot; notes a back-pressure stall the first time chunks wait with
        every slot held."""
        if self._queue and self._free:
            return True
        if self._queue and not self._stalled:
            self._stalled, self._stalled_since = True, time.monotonic()
            self._stalls += 1
        return False

    def _take_locked(self) -> tuple[int, QueuedChunk]:
        """The oldest queued chunk and the slot it goes into (only after :meth:`_ready_to_send_locked`)."""
        self._stalled = False
        slot = self._free.popleft()
        self._in_use.add(slot)
        return slot, self._queue.popleft()

    def _mark_written(self, count: int) -> None:
        with self._cv:
            self._written += count
            self._cv.notify_all()  # flush() waiters

    def _return_slots(self, slots: list[int]) -> None:
        with self._cv:
            for slot in slots:
                if slot in self._in_use:
                    self._in_use.discard(slot)
                    self._free.append(slot)
                else:  # never free a slot twice: it would be handed out twice
                    logger.warning("ignoring release of slot %d that is not in use", slot)
            self._cv.notify_all()

    def _fail(self, what: str, exc: BaseException) -> None:
        """A thread died: put()/flush() raise from now on and the owner hears of it instead of a silent stall."""
        logger.exception("connector %s failed", what)
        with self._cv:
            self._error = exc
            self._cv.notify_all()
        report(self._on_error, exc)


class ChunkReaderBase:
    """Code2wav side of any kind. The kind's receiver thread turns what arrives into :class:`SlotView` objects
    (:meth:`_hand_over`); ``release`` gives the slot back through the kind (:meth:`_send_release_locked`).

    The consumer waits with ``get`` / ``get_all_nowait`` and must ``release`` every chunk
    once it no longer needs ``chunk.codes``. Pass ``condition`` to share one Condition with
    other event sources of the engine loop (it is notified on every arrival).
    """

    def __init__(self, spec: SlotSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.spec = spec
        self._on_error = on_error
        self._cv = condition or threading.Condition()
        self._queue: collections.deque[SlotView] = collections.deque()
        self._held: dict[int, SlotView] = {}  # slot -> the chunk currently occupying it
        self._received = 0
        self._closed = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        raise NotImplementedError

    def get(self, timeout: float | None = None) -> SlotView | None:
        """The next chunk, waiting up to `timeout` seconds (None: forever); None on timeout or close."""
        with self._cv:
            self._cv.wait_for(lambda: self._queue or self._closed, timeout)
            return self._queue.popleft() if self._queue else None

    def get_all_nowait(self) -> list[SlotView]:
        """Every chunk received so far, in arrival order (per request: seq order)."""
        with self._cv:
            chunks = list(self._queue)
            self._queue.clear()
            return chunks

    def release(self, chunk: SlotView) -> None:
        """Give the chunk's slot back to the writer; ``chunk.codes`` is invalid afterwards.
        Releasing a chunk twice raises ValueError (it would free a slot another chunk uses)."""
        with self._cv:
            if self._held.get(chunk.slot) is not chunk:
                raise ValueError(f"chunk {chunk.request_id}#{chunk.seq} (slot {chunk.slot}) is not held")
            del self._held[chunk.slot]
            if not self._closed:
                # under the lock: zmq sockets are not thread-safe and release() may be called from any thread
                self._send_release_locked(chunk.slot)

    def stats(self) -> ReaderStats:
        with self._cv:
            return ReaderStats(chunks_received=self._received, queued=len(self._queue), slots_held=len(self._held))

    def close(self, timeout: float = 2.0) -> None:
        """Stop the receiver thread and let go of the transport; idempotent. Views still held by the caller
        stay readable until they are dropped."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
        self._stop(timeout)

    def __enter__(self) -> ChunkReaderBase:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- for the kinds ------------------------------------------------------------------------------------------
    def _send_release_locked(self, slot: int) -> None:
        """Tell the writer `slot` is free (the caller holds the lock; the reader is open)."""
        raise NotImplementedError

    def _stop(self, timeout: float) -> None:
        """close() after the bookkeeping: wake and join the threads, release sockets and transport."""
        raise NotImplementedError

    def _hand_over(self, chunks: list[SlotView]) -> None:
        """Received chunks to the consumer, in order; each holds its slot until released."""
        with self._cv:
            for chunk in chunks:
                if chunk.slot in self._held:  # protocol violation: keep the first holder
                    logger.warning("ignoring a chunk for slot %d that is still held", chunk.slot)
                    continue
                self._held[chunk.slot] = chunk
                self._queue.append(chunk)
                self._received += 1
            self._cv.notify_all()

    def _refuse(self, unreadable: list[tuple[int | None, Exception]]) -> None:
        """Chunks that could not be read (a writer bug; never handed on): the writer gets the known slots back,
        and the owner must hear of it, since each such chunk's request is now incomplete."""
        with self._cv:
            for slot, _ in unreadable:
                if slot is not None and not self._closed:
                    self._send_release_locked(slot)
        report(self._on_error, unreadable[0][1])

    def _fail(self, what: str, exc: BaseException) -> None:
        logger.exception("connector %s failed", what)
        report(self._on_error, exc)


def report(on_error: Callable[[BaseException], None] | None, exc: BaseException) -> None:
    if on_error is not None:
        on_error(exc)


def connect(sock: zmq.Socket, address: str) -> zmq.Socket:
    """`sock` (with its options set) connected to the peer's bound address (which may not exist yet); what it sends
    early is queued."""
    # If we start before the peer binds, the first chunks wait for a reconnect: retry after
    # 10 ms instead of the default 100 ms, backing off to 1 s so a dead peer costs nothing.
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(address)
    return sock


def unbounded_socket(ctx: zmq.Context, kind: int, ipv6: bool = False) -> zmq.Socket:
    """A socket with no high-water marks: what it queues is bounded by num_slots already, and a send with NOBLOCK
    must never fail for a full queue (a lost release would be a slot lost for good)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # a dead peer must never make close() hang
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def wake_pair(ctx: zmq.Context, tag: str) -> tuple[zmq.Socket, zmq.Socket]:
    """An inproc PAIR so another thread can wake (or pass slot indices to) one blocked in zmq.Poller.poll()
    without timeouts."""
    addr = f"inproc://omni-tts-wake-{tag}-{secrets.token_hex(4)}"
    rx = unbounded_socket(ctx, zmq.PAIR)
    rx.bind(addr)
    tx = unbounded_socket(ctx, zmq.PAIR)
    tx.connect(addr)
    return tx, rx


def drain_slots(sock: zmq.Socket) -> list[int]:
    """Every slot index already queued on `sock` (called after poll said it is readable)."""
    slots = []
    while True:
        try:
            msg = sock.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return slots
        if len(msg) == SLOT_MSG.size:
            slots.append(SLOT_MSG.unpack(msg)[0])
        else:
            logger.warning("dropping malformed connector message of %d bytes", len(msg))


def stop_threads(threads: list[threading.Thread], ctx: zmq.Context | None, sockets: list[zmq.Socket | None],
                 timeout: float, what: str) -> bool:
    """The shared tail of close(): join the threads, close the caller-side `sockets`, then end the context.
    False, with the context left alone, if a thread did not stop (terminating it under a live thread could hang or
    crash; the threads are daemons)."""
    for t in threads:
        t.join(timeout)
    stopped = not any(t.is_alive() for t in threads)
    for sock in sockets:
        if sock is not None:
            sock.close(linger=0)
    if not stopped:
        logger.error("%s threads did not stop within %.1fs; leaving them (daemon)", what, timeout)
        return False
    if ctx is not None:
        ctx.term()
    return True
