"""Which talker requests run this step, and what their sampled tokens mean: torch-free bookkeeping.

Rows are slots of the runner's device buffers: rows 0..B-1 are the running requests, in order. A step admits
waiting requests into the next free rows (their prompts prefilled together, within a token budget so running
requests never stall for long), decodes every running row, then reads the step's tokens: a row ends at EOS or
at its token limit and is freed by moving the last running row into its hole (the runner copies the buffers).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from omni_tts.models.qwen3_tts.sampling import ResolvedSampling


@dataclass
class TalkerRequest:
    """One request's whole talker-side state: its inputs (read by the runner once, at prefill) and its counters."""
    request_id: str
    prefill: "torch.Tensor"    # [L, H] on the engine's device
    trailing: "torch.Tensor"   # [T, H]
    sampling: "ResolvedSampling"
    max_tokens: int            # sampled-token limit (N tokens give at most N - 1 frames)
    length: int = 0            # cache slots in use
    num_tokens: int = 0        # c0 tokens sampled so far
    num_frames: int = 0

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
    """One step's work: prefill `admitted` into rows first_row.., then decode rows 0..num_rows-1."""
    admitted: list[TalkerRequest]
    first_row: int
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
    free_rows: int
    request_ids: list[str] = field(default_factory=list)


class TalkerScheduler:
    def __init__(self, max_rows: int, max_model_len: int, max_prefill_tokens: int, max_text_tokens: int,
                 eos_token_id: int) -> None:
        self.max_rows, self.max_model_len = max_rows, max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.max_trailing = max_text_tokens + 1  # + the tts_eos row of the streaming layout
        self.eos = eos_token_id
        self.waiting: deque[TalkerRequest] = deque()
        self.running: list[TalkerRequest] = []

    def add(self, request: TalkerRequest) -> None:
        """Queue a request; it is admitted when a row is free. ValueError if it can never fit."""
        length = request.prompt_len
        if length >= self.max_model_len:
            raise ValueError(f"prompt of {length} positions does not fit max_model_len {self.max_model_len}")
        if request.trailing.shape[0] > self.max_trailing:
            raise ValueError(f"text of {request.trailing.shape[0] - 1} tokens exceeds max_text_tokens "
                             f"{self.max_trailing - 1}")
        # N tokens occupy L + N - 1 slots (the last token is never fed)
        request.max_tokens = min(request.max_tokens, self.max_model_len - length + 1)
        self.waiting.append(request)

    def abort(self, request_id: str) -> list[RowMove] | None:
        """Drop a waiting or running request: None if unknown, else the row moves that close its hole."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return []
        for row, request in enumerate(self.running):
            if request.request_id == request_id:
                return self._release([row])
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> TalkerSchedulerStats:
        return TalkerSchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                                    free_rows=self.max_rows - len(self.running),
                                    request_ids=[r.request_id for r in self.running + list(self.waiting)])

    # --- one step: schedule → (the runner runs it) → postprocess ---------------------------------------------
    def schedule(self) -> TalkerSchedule:
        first_row, admitted, budget = len(self.running), [], self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_rows:
            length = self.waiting[0].prompt_len
            if budget < self.max_prefill_tokens and length > budget:
                break  # the rest waits for the next step: running requests keep their pace
            request = self.waiting.popleft()
            budget -= length
            request.length, request.num_tokens = length, 1  # the prefill samples the first c0
            admitted.append(request)
            self.running.append(request)
        num_slots = max((r.length for r in self.running), default=0) + 1
        return TalkerSchedule(admitted, first_row, len(self.running), num_slots)

    def postprocess(self, schedule: TalkerSchedule, tokens: np.ndarray) -> tuple[list[FrameOutput], list[RowMove]]:
        """tokens: [num_rows, 17] host copy of the step (16 frame codes + the next c0). Returns the step's frames
        and the row moves that free the finished rows."""
        outputs, finished = [], []
        for row, request in enumerate(self.running[:schedule.num_rows]):
            if request.num_tokens >= request.max_tokens:  # a one-token budget: its prefill was its only token
                outputs.append(FrameOutput(request.request_id, None, True, "length"))
                finished.append(row)
                continue
            request.length += 1
            request.num_tokens += 1
            request.num_frames += 1
            stop = int(tokens[row, 16]) == self.eos
            done = stop or request.num_tokens >= request.max_tokens
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
