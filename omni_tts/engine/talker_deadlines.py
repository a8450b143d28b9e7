"""Deadline-first talker steps: whether a step's admissions wait one step for a stream about to run dry.

A streaming request's player runs dry at its playback deadline: the time its first frame was made plus the audio
of the frames made since (80 ms a frame at 12.5 Hz); a player that ran dry (the row waited for text, or the talker
fell behind) resumes with the next frame, so that frame's time restarts the count. A margin is kept for the way to
the player (the connector, code2wav's decode, the socket). Frames the chunker still holds count as made (the
scheduler does not see chunks), so a stream's slack is overstated by at most its current chunk's audio: small
chunks while a stream is young, when its slack is smallest.

A step admits waiting requests by prefilling their prompts before its decode, so every running row waits for the
prefill. Nari's order (../shared/docs/gpu_leaders.md, `DeadlineAwarePolicy`: a stream about to run dry first, then
new requests' startup work, then streams within a second of their deadline, then the rest) comes down here to one
choice per step. If some running row's slack (deadline - now) is below the expected cost of a prefill plus a step,
the step decodes first and the admission waits: one step gives that row 80 ms of audio for a step's time, so the
prefill no longer empties its player. Otherwise admissions go first, as startup work should. "Within a second, then
the rest" orders streams that compete for a step; all of the talker's running rows decode in every step (one
batched forward), so they never compete and that order is not built. (Code2wav's streams do compete, for its frame
budget, and its scheduler orders them by deadline: code2wav_scheduler.py.)

No starvation: at most `max_deferred_steps` (1) steps in a row defer, so the step after a deferral admits whatever
the rows' slack, and a request with a free row waits at most one step more than it would have. Waiting longer cannot
save a row still short of slack after a step: the talker is then slower than real time, and only admitting fewer
requests would help.

The costs are measured with the scheduler's clock, from `schedule` to `postprocess`: a device prefill is queued
asynchronously and the step's one host copy waits for it, so only the whole step measures it. The step cost is a
running average of the steps that admit nothing, the prefill cost one of what admitting steps take beyond it. Both
start at 0 (until measured, only a row within the margin of its deadline, or past it, defers an admission). No
torch here.
"""
from __future__ import annotations

from collections.abc import Callable

FRAME_SECONDS = 0.08          # audio per codec frame: the 12 Hz checkpoints' 1920 samples at 24 kHz
DECODE_MARGIN_SECONDS = 0.02  # from the talker's frame to the player: the connector, code2wav's decode, the socket
COST_WEIGHT = 0.1             # a new measurement's weight in the running averages


class PlaybackDeadlines:
    """The talker's side of deadline-first steps: the step and prefill costs, and whether a step defers."""

    def __init__(self, clock: Callable[[], float], margin: float = DECODE_MARGIN_SECONDS,
                 max_deferred_steps: int = 1) -> None:
        """clock: monotonic seconds (tests drive a fake one)."""
        self.clock, self.margin, self.max_deferred_steps = clock, margin, max_deferred_steps
        self.step_cost: float | None = None     # seconds, None until a step that admits nothing is measured
        self.prefill_cost: float | None = None  # seconds an admission adds to its step
        self.num_deferred_steps = 0             # in a row, since the last admission
        self.step_start: float | None = None
        self.step_admits = False

    def defers_admission(self, deadlines: list[float | None]) -> bool:
        """Whether this step decodes before admitting; deadlines: the running rows' (`next_deadline`), None for a
        row with no frame yet (startup work, not a stream that can run dry). Call it only for a step that has a
        request to admit; a step that admits resets the count of deferrals."""
        if self.num_deferred_steps < self.max_deferred_steps:
            now, needed = self.clock(), (self.prefill_cost or 0.0) + (self.step_cost or 0.0)
            if any(d is not None and d - self.margin - now < needed for d in deadlines):
                self.num_deferred_steps += 1
                return True
        self.num_deferred_steps = 0
        return False

    def step_started(self, admits: bool) -> None:
        self.step_start, self.step_admits = self.clock(), admits

    def step_finished(self) -> float:
        """Book the step's duration; returns the time (when its frames were made)."""
        now = self.clock()
        if self.step_start is not None:
            seconds = now - self.step_start
            if not self.step_admits:
                self.step_cost = _averaged(self.step_cost, seconds)
            elif self.step_cost is not None:
                self.prefill_cost = _averaged(self.prefill_cost, max(0.0, seconds - self.step_cost))
            self.step_start = None
        return now


def next_deadline(deadline: float | None, now: float) -> float:
    """A row's deadline after a frame made at `now`: a frame's audio later, from `now` when its player is dry."""
    return (now if deadline is None else max(deadline, now)) + FRAME_SECONDS


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else average + COST_WEIGHT * (sample - average)
