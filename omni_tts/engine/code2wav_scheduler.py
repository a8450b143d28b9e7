"""Code2wav scheduling: which requests' codec frames the next decoder call takes, earliest playback deadline first.

A streaming request's player runs dry at a known time, its deadline: when its first audio left this stage plus the
seconds of audio sent since. A request that has sent no audio yet has had a dry player since it arrived, so its
deadline is its arrival time: earlier than that of every stream still ahead of playback, so first chunks go first
(time to first audio), ties in arrival order; only a stream that ran dry before the new request arrived goes before
it. A waiting request's deadline never moves and later arrivals get later ones, so no request starves.

Each step takes requests in deadline order, each contributing one piece of its oldest pending chunk, until the
per-call frame budget (frames summed over the batch) of every lane is spent or `max_batch_size` requests are in.
Lanes are decoder calls that run at once (the engine gives each its own thread); they fill in turn, so the most
urgent pieces share lane 0 and a request is in one lane per step. A chunk longer than the budget left is split: the
streaming decoder is exact for any split, so a piece costs only a call, while a bounded call bounds how long a new
request's first chunk waits behind the other streams' 25-frame chunks. The first piece of a lane always gets at
least one frame. A split chunk's audio still leaves whole when its last piece is decoded (the engine joins the
pieces), so clients see the chunks the talker cut, and the clock advances then.

Context chunks (ICL reference codes) prime the decoder state, emit no audio and do not start the clock. No torch
here: the engine decodes the batch.
"""
from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class CodecChunk:
    """A request's codec frames as code2wav owns them (copied out of the connector's `SlotView`)."""
    codes: np.ndarray          # [F, 16] int
    is_last: bool = False
    is_context: bool = False   # decoder left context (ICL reference codes): decoded, not emitted


@dataclass
class ScheduledPiece:
    """Frames [start, end) of one request's oldest chunk, decoded in this step."""
    request_id: str
    chunk: CodecChunk
    start: int
    end: int
    lane: int = 0              # which of the step's concurrent decoder calls takes it

    @property
    def codes(self) -> np.ndarray:
        return self.chunk.codes[self.start:self.end]   # [F, 16]

    @property
    def num_frames(self) -> int:
        return self.end - self.start

    @property
    def ends_chunk(self) -> bool:
        return self.end == self.chunk.codes.shape[0]

    @property
    def is_last(self) -> bool:
        """Ends the request's last chunk: the request is freed after this step."""
        return self.chunk.is_last and self.ends_chunk


class Code2WavRequest:
    """One request's queued chunks and its playback clock."""

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.chunks: deque[CodecChunk] = deque()
        self.num_taken = 0               # frames of chunks[0] already scheduled (a chunk may span steps)
        self.deadline = arrival_time     # monotonic seconds when its player runs (or ran) dry
        self.has_audio = False

    def take(self, budget_left: int, lane: int) -> ScheduledPiece:
        """The next at most `budget_left` frames of the oldest chunk."""
        chunk, start = self.chunks[0], self.num_taken
        piece = ScheduledPiece(self.request_id, chunk, start, min(chunk.codes.shape[0], start + budget_left), lane)
        if piece.ends_chunk:
            self.chunks.popleft()
        self.num_taken = 0 if piece.ends_chunk else piece.end
        return piece


class Code2WavScheduler:
    """Owns the requests' chunk queues and playback clocks; `schedule` picks a step's pieces, `postprocess` books them.

    `frame_budget` None means no budget (whole chunks of up to `max_batch_size` requests per step, in one lane);
    otherwise it bounds each of the `lanes` decoder calls of a step.
    """

    def __init__(self, max_batch_size: int, frame_budget: int | None, frame_seconds: float,
                 lanes: int = 1) -> None:
        self.max_batch_size = max_batch_size
        self.frame_budget = sys.maxsize if frame_budget is None else frame_budget
        self.lanes = lanes
        self.frame_seconds = frame_seconds   # audio seconds per codec frame
        self.requests: dict[str, Code2WavRequest] = {}

    def add_request(self, request_id: str, now: float) -> None:
        if request_id not in self.requests:
            self.requests[request_id] = Code2WavRequest(request_id, now)

    def add_chunk(self, request_id: str, chunk: CodecChunk) -> bool:
        """Queue a chunk; False if the request is unknown (aborted, finished or never registered)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.chunks.append(chunk)
        return True

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return any(request.chunks for request in self.requests.values())

    def schedule(self) -> list[ScheduledPiece]:
        # sorted() is stable and the dict keeps arrival order: equal deadlines go in arrival order
        ready = sorted((r for r in self.requests.values() if r.chunks), key=lambda r: r.deadline)
        batch: list[ScheduledPiece] = []
        lane, budget_left = 0, self.frame_budget
        for request in ready[:self.max_batch_size]:
            if budget_left == 0:
                lane, budget_left = lane + 1, self.frame_budget
                if lane == self.lanes:
                    break
            batch.append(request.take(budget_left, lane))
            budget_left -= batch[-1].num_frames
        return batch

    def postprocess(self, batch: list[ScheduledPiece], now: float) -> None:
        """Advance the clocks of the requests whose chunk's audio left at `now`; forget finished requests."""
        for piece in batch:
            request = self.requests[piece.request_id]
            num_frames = piece.chunk.codes.shape[0]
            if piece.ends_chunk and num_frames and not piece.chunk.is_context:
                if not request.has_audio:
                    request.deadline, request.has_audio = now, True
                request.deadline += num_frames * self.frame_seconds
            if piece.is_last:
                del self.requests[piece.request_id]
