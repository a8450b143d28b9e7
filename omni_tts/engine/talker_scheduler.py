"""Which talker requests run this step, and what their sampled tokens mean: torch-free bookkeeping.

Rows are slots of the runner's device buffers: rows 0..B-1 are the running requests, in order. A step admits
waiting requests into the next free rows (their prompts prefilled together, within a token budget so running
requests never stall for long), decodes every running row, then reads the step's tokens: a row ends at EOS or
at its token limit and is freed by moving the last running row into its hole (the runner copies the buffers).
Admission is deadline-first (talker_deadlines.py): when a running row's player is about to run dry, the step
decodes first and its admissions wait one step, never more.

A request whose text is still arriving (`text_done` False) reads one trailing text row per step. When its next
step needs a row that has not arrived, it is parked: moved to the top of the buffers (rows num_buffer_rows-1,
-2, …), out of the decoded range, until text arrives. Rows in use (running + parked) never exceed max_rows and
the buffers hold num_buffer_rows > max_rows, so a row moving back always finds row B free, and the rows a
static-shape step pads the batch with (B..bucket-1, at most num_buffer_rows - max_rows of them) never reach a
parked row.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .talker_deadlines import PlaybackDeadlines, next_deadline

if TYPE_CHECKING:
    import torch

    from omni_tts.models.qwen3_tts.sampling import ResolvedSampling


def max_trailing_rows(max_text_tokens: int) -> int:
    """Trailing text rows a request may have: its text tokens but the first, + tts_eos (§7.2; ICL needs fewer)."""
    return max_text_tokens + 1


@dataclass
class TalkerRequest:
    """One request's whole talker-side state: its inputs (read by the runner once, at prefill) and its counters."""
    request_id: str
    prefill: "torch.Tensor"    # [L, H] on the engine's device
    trailing: "torch.Tensor"   # [T, H]: the trailing text rows known so far (the runner reads them at prefill)
    sampling: "ResolvedSampling"
    max_tokens: int            # sampled-token limit (N tokens give at most N - 1 frames); while the text is open,
                               # the limit for the text so far, where the row waits rather than ends
    text_done: bool = True     # False: more trailing rows come by append_text, the last with done
    lora: str | None = None    # the LoRA adapter it runs with (its name), None = the base model
    lora_slot: int = 0         # that adapter's slot (the engine's; 0 = none)
    num_trailing: int = 0      # trailing rows given so far
    length: int = 0            # cache slots in use
    num_tokens: int = 0        # c0 tokens sampled so far
    num_frames: int = 0
    deadline: float | None = None   # when its player runs dry (talker_deadlines.py); None before its first frame

    @property
    def prompt_len(self) -> int:
        return self.prefill.shape[0]


@dataclass
class FrameOutput:
    request_id: str
    frame: np.ndarray | None   # [16] int codes of this step's frame, None when the request ends without one
    finished: bool = False
    finish_reason: str | None = None   # "stop" (EOS) | "length" | "abort"


@dataclass
class TalkerSchedule:
    """One step's work, in order: move the rows that rejoin the batch (`unparked`), prefill `admitted` into rows
    first_row.., move the rows that cannot step out of the batch (`parked`), then decode rows 0..num_rows-1."""
    unparked: list["RowMove"]
    admitted: list[TalkerRequest]
    first_row: int
    parked: list["RowMove"]
    num_rows: int
    num_slots: int             # attention slots the decode needs: the longest row's length + 1


@dataclass
class RowMove:
    """The runner copies row src (its first `length` cache slots and per-row state) to row dst."""
    src: int
    dst: int
    length: int


@dataclass
class TalkerSchedulerStats:
    num_running: int
    num_waiting: int
    num_parked: int
    free_rows: int
    request_ids: list[str] = field(default_factory=list)
    num_deferred_admissions: int = 0   # admissions put off a step for a stream about to run dry (cumulative)


class TalkerScheduler:
    def __init__(self, max_rows: int, num_buffer_rows: int, max_model_len: int, max_prefill_tokens: int,
                 max_text_tokens: int, eos_token_id: int, clock: Callable[[], float] = time.monotonic) -> None:
        """clock: monotonic seconds, for the rows' playback deadlines (tests drive a fake one)."""
        assert num_buffer_rows > max_rows
        self.max_rows, self.num_buffer_rows, self.max_model_len = max_rows, num_buffer_rows, max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.max_trailing = max_trailing_rows(max_text_tokens)
        self.eos = eos_token_id
        self.waiting: deque[TalkerRequest] = deque()
        self.running: list[TalkerRequest] = []
        self.parked: list[TalkerRequest] = []   # parked[i] is in row num_buffer_rows - 1 - i
        self.deadlines = PlaybackDeadlines(clock)
        self.num_deferred_admissions = 0

    def add(self, request: TalkerRequest) -> None:
        """Queue a request; it is admitted when a row is free. ValueError if it can never fit."""
        length = request.prompt_len
        if length >= self.max_model_len:
            raise ValueError(f"prompt of {length} positions does not fit max_model_len {self.max_model_len}")
        request.num_trailing = 0
        self._add_trailing(request, request.trailing.shape[0], request.max_tokens, request.text_done)
        self.waiting.append(request)

    def append_text(self, request_id: str, num_rows: int, max_tokens: int,
                    done: bool) -> tuple[TalkerRequest, int | None, int] | None:
        """More trailing rows for a request whose text is open: None if the request is unknown (it ended), else
        the request, its row (None while it waits for admission) and where the new rows start in its trailing
        text. ValueError beyond max_text_tokens."""
        request, row = self._find(request_id)
        if request is None:
            return None
        if request.text_done:
            raise ValueError(f"request {request_id}: text after its end")
        start = request.num_trailing
        self._add_trailing(request, num_rows, max_tokens, done)
        return request, row, start

    def _add_trailing(self, request: TalkerRequest, num_rows: int, max_tokens: int, done: bool) -> None:
        if request.num_trailing + num_rows > self.max_trailing:
            raise ValueError(f"text of {request.num_trailing + num_rows - 1} tokens exceeds max_text_tokens "
                             f"{self.max_trailing - 1}")
        request.num_trailing += num_rows
        # N tokens occupy L + N - 1 slots (the last token is never fed)
        request.max_tokens = min(max_tokens, self._token_room(request))
        request.text_done = done

    def _token_room(self, request: TalkerRequest) -> int:
        return self.max_model_len - request.prompt_len + 1

    def _find(self, request_id: str) -> tuple[TalkerRequest | None, int | None]:
        for request in self.waiting:
            if request.request_id == request_id:
                return request, None
        for row, request in enumerate(self.running):
            if request.request_id == request_id:
                return request, row
        for i, request in enumerate(self.parked):
            if request.request_id == request_id:
                return request, self.num_buffer_rows - 1 - i
        return None, None

    def abort(self, request_id: str) -> list[RowMove] | None:
        """Drop a waiting, running or parked request: None if unknown, else the row moves that close its hole."""
        request, row = self._find(request_id)
        if request is None:
            return None
        if row is None:
            self.waiting.remove(request)
            return []
        if row < len(self.running):
            return self._release([row])
        return self._remove_parked(self.parked.index(request))

    def has_work(self) -> bool:
        """Something to run: rows running or about to rejoin, or a request and a free row for it."""
        return (bool(self.running) or any(self._can_step(r) for r in self.parked)
                or (bool(self.waiting) and self._num_rows_in_use() < self.max_rows))

    def stats(self) -> TalkerSchedulerStats:
        return TalkerSchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                                    num_parked=len(self.parked), free_rows=self.max_rows - self._num_rows_in_use(),
                                    request_ids=[r.request_id for r in self.requests()],
                                    num_deferred_admissions=self.num_deferred_admissions)

    @property
    def num_requests(self) -> int:
        """Requests it holds: running, parked, waiting (the talker's load)."""
        return len(self.running) + len(self.parked) + len(self.waiting)

    def requests(self) -> list[TalkerRequest]:
        """Every request it holds: running, parked, waiting."""
        return self.running + self.parked + list(self.waiting)

    def _num_rows_in_use(self) -> int:
        return len(self.running) + len(self.parked)

    def waiting_for_text(self) -> list[str]:
        """Requests in rows (running or parked) whose next step needs text that has not arrived."""
        return [r.request_id for r in self.running + self.parked if not self._can_step(r)]

    def _can_step(self, request: TalkerRequest) -> bool:
        """Whether the row's next step has its inputs: with open text, the trailing row it reads (else it would
        read tts_pad, which ends the speech) and room within the limit for the text so far."""
        return request.text_done or (request.num_frames < request.num_trailing
                                     and request.num_tokens < request.max_tokens)

    def _length_reached(self, request: TalkerRequest) -> bool:
        """Ends by length: at its token limit once the text is whole (before, the limit only makes it wait), or at
        the end of its cache."""
        return request.num_tokens >= (request.max_tokens if request.text_done else self._token_room(request))

    # --- one step: schedule → (the runner runs it) → postprocess ---------------------------------------------
    def schedule(self) -> TalkerSchedule:
        unparked = []
        for request in [r for r in self.parked if self._can_step(r)]:
            unparked += self._unpark(self.parked.index(request))
        first_row, admitted = len(self.running), []
        num_admitted = self._num_admissible()
        if num_admitted and self.deadlines.defers_admission([r.deadline for r in self.running]):
            self.num_deferred_admissions += num_admitted
            num_admitted = 0
        for _ in range(num_admitted):
            request = self.waiting.popleft()
            request.length, request.num_tokens = request.prompt_len, 1  # the prefill samples the first c0
            admitted.append(request)
            self.running.append(request)
        self.deadlines.step_started(admits=bool(admitted))
        parked = []
        for row in reversed(range(len(self.running))):  # descending: no hole is filled from a row parked after it
            if not self._can_step(self.running[row]):
                parked += self._park(row)
        num_slots = max((r.length for r in self.running), default=0) + 1
        return TalkerSchedule(unparked, admitted, first_row, parked, len(self.running), num_slots)

    def _num_admissible(self) -> int:
        """Waiting requests this step can admit: into free rows, within the prefill token budget (the first always
        fits: a prompt larger than the budget goes alone), so running requests keep their pace."""
        num, budget = 0, self.max_prefill_tokens
        for request in itertools.islice(self.waiting, self.max_rows - self._num_rows_in_use()):
            if num and request.prompt_len > budget:
                break
            num, budget = num + 1, budget - request.prompt_len
        return num

    def postprocess(self, schedule: TalkerSchedule, tokens: np.ndarray) -> tuple[list[FrameOutput], list[RowMove]]:
        """tokens: [num_rows, 17] host copy of the step (16 frame codes + the next c0). Returns the step's frames
        and the row moves that free the finished rows."""
        now = self.deadlines.step_finished()
        outputs, finished = [], []
        for row, request in enumerate(self.running[:schedule.num_rows]):
            if self._length_reached(request):  # the limit came before this step: a one-token budget (the prefill's
                outputs.append(FrameOutput(request.request_id, None, True, "length"))  # token), or text ended late
                finished.append(row)
                continue
            request.length += 1
            request.num_tokens += 1
            request.num_frames += 1
            request.deadline = next_deadline(request.deadline, now)
            stop = int(tokens[row, 16]) == self.eos
            done = stop or self._length_reached(request)
            outputs.append(FrameOutput(request.request_id, tokens[row, :16], done,
                                       ("stop" if stop else "length") if done else None))
            if done:
                finished.append(row)
        return outputs, self._release(finished)

    def _release(self, rows: list[int]) -> list[RowMove]:
        """Free rows, moving the last running row into each hole (descending, so no hole is refilled from a row
        that is itself being freed)."""
        moves = []
        for row in sorted(rows, reverse=True):
            last = len(self.running) - 1
            if row != last:
                moved = self.running[last]
                moves.append(RowMove(last, row, moved.length))
                self.running[row] = moved
            self.running.pop()
        return moves

    def _park(self, row: int) -> list[RowMove]:
        """Move a running row to the top of the parked rows, and the last running row into its hole."""
        request = self.running[row]
        moves = [RowMove(row, self.num_buffer_rows - 1 - len(self.parked), request.length)]
        self.parked.append(request)
        return moves + self._release([row])

    def _unpark(self, index: int) -> list[RowMove]:
        """Move parked[index] back to row B (free: rows in use < num_buffer_rows), and the lowest parked row into
        its hole."""
        request = self.parked[index]
        moves = [RowMove(self.num_buffer_rows - 1 - index, len(self.running), request.length)]
        self.running.append(request)
        return moves + self._remove_parked(index)

    def _remove_parked(self, index: int) -> list[RowMove]:
        last = len(self.parked) - 1
        moves = []
        if index != last:
            moved = self.parked[last]
            moves.append(RowMove(self.num_buffer_rows - 1 - last, self.num_buffer_rows - 1 - index, moved.length))
            self.parked[index] = moved
        self.parked.pop()
        return moves
