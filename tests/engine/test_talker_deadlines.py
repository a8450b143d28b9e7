"""Deadline-first talker steps (engine/talker_deadlines.py) on the torch-free scheduler, driven by a fake clock: a
stream about to run dry gets its decode before a step's admissions, which wait one step and never more."""
import pytest

from omni_tts.engine.talker_deadlines import DECODE_MARGIN_SECONDS, FRAME_SECONDS, PlaybackDeadlines, next_deadline
from omni_tts.engine.talker_scheduler import TalkerScheduler
from test_talker_engine import EOS, fake_request, tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(s: TalkerScheduler, clock: FakeClock, seconds: float) -> list[str]:
    """One step that takes `seconds`; returns the ids it admitted."""
    schedule = s.schedule()
    clock.now += seconds
    s.postprocess(schedule, tokens(schedule.num_rows))
    return [r.request_id for r in schedule.admitted]


def warmed(clock: FakeClock) -> TalkerScheduler:
    """A scheduler that measured a 20 ms step and a prefill of 30 ms more, running stream a (3 frames) and stream b
    (1 frame, made now)."""
    s = TalkerScheduler(max_rows=16, num_buffer_rows=17, max_model_len=1000, max_prefill_tokens=1000,
                        max_text_tokens=10, eos_token_id=EOS, clock=clock)
    s.add(fake_request("a", 10))
    assert step(s, clock, 0.05) == ["a"]       # nothing measured yet: a prefill without a step cost to subtract
    assert step(s, clock, 0.02) == []          # a step that admits nothing: the step cost
    s.add(fake_request("b", 10))
    assert step(s, clock, 0.05) == ["b"]       # admitting costs 30 ms more: the prefill cost
    assert (s.deadlines.step_cost, s.deadlines.prefill_cost) == pytest.approx((0.02, 0.03))
    a, b = s.running
    assert a.deadline == pytest.approx(100.05 + 3 * FRAME_SECONDS)   # its first frame's time + 80 ms a frame
    assert b.deadline == pytest.approx(clock.now + FRAME_SECONDS)
    return s


def test_an_urgent_stream_defers_an_admission_by_one_step():
    clock = FakeClock()
    s = warmed(clock)
    a = s.running[0]
    clock.now = a.deadline - DECODE_MARGIN_SECONDS - 0.04   # a's slack 40 ms, below a prefill + a step (50 ms)
    s.add(fake_request("c", 10))
    schedule = s.schedule()
    assert schedule.admitted == [] and schedule.num_rows == 2 and list(s.waiting)[0].request_id == "c"
    assert s.stats().num_deferred_admissions == 1
    clock.now += 0.02
    s.postprocess(schedule, tokens(2))
    assert step(s, clock, 0.05) == ["c"]    # one step later, whatever the slack
    assert s.stats().num_deferred_admissions == 1


def test_streams_with_slack_let_admissions_go_first():
    clock = FakeClock()
    s = warmed(clock)
    # b's slack: 80 ms of audio less the margin (60 ms), above a prefill + a step (50 ms); a has more
    s.add(fake_request("c", 10))
    assert step(s, clock, 0.05) == ["c"]
    assert s.stats().num_deferred_admissions == 0


def test_a_continuously_urgent_batch_still_admits_within_one_step():
    clock = FakeClock()
    s = warmed(clock)
    joined, admitted_at = {}, {}
    for i in range(9):   # a request joins every step but the last, and every step takes 200 ms: the players
        if i < 8:        # run dry (the talker is slower than real time)
            s.add(fake_request(f"n{i}", 10))
            joined[f"n{i}"] = i
        for request_id in step(s, clock, 0.2):
            admitted_at[request_id] = i
    assert set(admitted_at) == set(joined)
    assert max(admitted_at[r] - joined[r] for r in joined) == 1   # a deferral, but never two in a row
    # n0 came while the streams had slack; from then on every other step defers: n1, n3, n5, n7 waited a step each
    assert admitted_at["n0"] == 0
    assert s.stats().num_deferred_admissions == 4


def test_rows_without_a_frame_are_startup_work_and_a_dry_player_restarts_from_its_next_frame():
    deadlines = PlaybackDeadlines(lambda: 50.0)
    deadlines.step_cost, deadlines.prefill_cost = 1.0, 1.0
    assert not deadlines.defers_admission([None, None])                # nothing streams yet: admit
    assert deadlines.defers_admission([None, 50.5])                    # a stream due in 0.5 s: decode first
    assert not deadlines.defers_admission([None, 50.5])                # ... for one step only
    assert next_deadline(None, 10.0) == pytest.approx(10.0 + FRAME_SECONDS)    # the first frame starts the count
    assert next_deadline(12.0, 10.0) == pytest.approx(12.0 + FRAME_SECONDS)    # ahead: 80 ms more
    assert next_deadline(9.0, 10.0) == pytest.approx(10.0 + FRAME_SECONDS)     # ran dry: from this frame on
