"""The in-process connector: talker and code2wav in one process (the fused layout, `qwen3_tts_1gpu_fused.yaml`).

No transport and no thread: ``put`` hands a chunk straight to the reader while a slot is free, and a ``release``
hands on what waited for one. The slots bound what is in flight as in the other kinds (back-pressure is the same),
and a chunk is the same :class:`SlotView` the reader of any kind gives out. Both ends are made together
(:func:`local_pair`) by the process that runs both stages.

Locking: the writer's lock is never held while the reader's is taken (a release, under the reader's lock, takes the
writer's for its bookkeeping and lets it go before handing chunks over), so the two loops cannot deadlock. Two
threads can each have taken chunks (the talker's put, code2wav's release) before either hands them over: each take
gets a ticket under the writer's lock, and the reader delivers takes in ticket order, so chunks arrive in put order.
"""
from __future__ import annotations

import threading
from typing import Callable

import msgspec

from .base import ChunkReaderBase, ChunkWriterBase, SlotView


class LocalSpec(msgspec.Struct, frozen=True, tag="local"):
    """The slots of an in-process connector; both stages must run in the process that holds it."""
    num_slots: int
    max_frames: int
    num_codebooks: int


class LocalOwner:
    """The orchestrator's side: nothing to create or remove, only the spec the fused process builds its pair from."""

    def __init__(self, spec: LocalSpec) -> None:
        self.spec = spec

    @classmethod
    def create(cls, num_slots: int, max_frames: int, num_codebooks: int = 16) -> LocalOwner:
        return cls(LocalSpec(num_slots=num_slots, max_frames=max_frames, num_codebooks=num_codebooks))

    def close(self) -> None:
        pass


class LocalChunkReader(ChunkReaderBase):
    def __init__(self, spec: LocalSpec, condition: threading.Condition | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(spec, condition, on_error)
        self.writer: LocalChunkWriter | None = None
        self._next_ticket = 0                        # the writer's take to deliver next
        self._early_takes: dict[int, list[SlotView]] = {}   # takes whose earlier ones are still on their way

    def _hand_over_take(self, ticket: int, chunks: list[SlotView]) -> None:
        """The writer's take `ticket`, delivered after every earlier take (each take is in put order)."""
        with self._cv:
            self._early_takes[ticket] = chunks
            while self._next_ticket in self._early_takes:
                self._hand_over(self._early_takes.pop(self._next_ticket))
                self._next_ticket += 1

    def start(self) -> None:
        pass

    def _send_release_locked(self, slot: int) -> None:
        assert self.writer is not None
        self.writer._return_slots([slot])
        self.writer.pump()

    def _stop(self, timeout: float) -> None:
        pass


class LocalChunkWriter(ChunkWriterBase):
    def __init__(self, spec: LocalSpec, reader: LocalChunkReader,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(spec, on_error)
        self.reader = reader
        self._tickets = 0   # takes so far (under the lock): the order the reader delivers them in

    def start(self) -> None:
        pass

    def put(self, request_id: str, seq: int, codes, is_last: bool, is_context: bool = False) -> None:
        super().put(request_id, seq, codes, is_last, is_context)
        self.pump()

    def pump(self) -> None:
        """Every queued chunk that has a free slot, to the reader (taken under the writer's lock with its ticket,
        handed over outside it)."""
        with self._cv:
            taken = []
            while not self._closed and self._ready_to_send_locked():
                taken.append(self._take_locked())
            if not taken:
                return
            ticket, self._tickets = self._tickets, self._tickets + 1
        self.reader._hand_over_take(ticket, [SlotView.from_wire(rid, seq, put_ns, codes, flags, slot)
                                             for slot, (rid, seq, put_ns, codes, flags) in taken])
        self._mark_written(len(taken))

    def _wake_sender_locked(self) -> None:
        pass  # put() pumps once it has let go of the lock

    def _stop(self, timeout: float) -> None:
        pass


def local_pair(spec: LocalSpec, condition: threading.Condition | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> tuple[LocalChunkWriter, LocalChunkReader]:
    """Both ends of one in-process connector; `condition` is the reader's (code2wav's loop wakes on arrivals)."""
    reader = LocalChunkReader(spec, condition, on_error)
    writer = reader.writer = LocalChunkWriter(spec, reader, on_error)
    return writer, reader
