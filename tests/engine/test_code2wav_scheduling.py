"""Code2wav scheduling: deadline order, frame budget, splits, starvation, abort; engine audio == one-pass decode;
the start-up frame-budget calibration."""
import multiprocessing
import shutil

import msgspec
import numpy as np
import pytest
import torch
import zmq

from conftest import FIXTURES, load_component
from omni_tts.config import Code2WavStageConfig, PipelineConfig, StagesConfig, TalkerStageConfig
from omni_tts.connectors.shm_ring import RingOwner
from omni_tts.engine import code2wav_engine
from omni_tts.engine.code2wav_engine import Code2WavEngine, measure_frame_budget
from omni_tts.engine.code2wav_runner import Code2WavRunner
from omni_tts.engine.code2wav_scheduler import CodecChunk, Code2WavScheduler
from omni_tts.models.qwen3_tts.checkpoint_config import SpeechTokenizerConfig
from omni_tts.models.qwen3_tts.speech_decoder import SpeechDecoder
from omni_tts.stages import code2wav_stage
from omni_tts.stages.messages import Heartbeat, Ready, Shutdown, StageEvent, StageLaunch

FRAME_SECONDS = 0.08


def chunk(frames: int, **flags) -> CodecChunk:
    return CodecChunk(np.arange(frames * 16).reshape(frames, 16), **flags)


def scheduler(max_batch_size: int = 8, frame_budget: int | None = 16, lanes: int = 1) -> Code2WavScheduler:
    return Code2WavScheduler(max_batch_size, frame_budget, FRAME_SECONDS, lanes)


def step(s: Code2WavScheduler, now: float) -> list[tuple[str, int]]:
    batch = s.schedule()
    s.postprocess(batch, now)
    return [(p.request_id, p.num_frames) for p in batch]


# ------------------------------------------------------------------------------------------------------------
# Scheduler
# ------------------------------------------------------------------------------------------------------------
def test_first_chunks_go_first_in_arrival_order_then_by_deadline():
    s = scheduler(frame_budget=100)
    for rid, arrival in (("a", 0.0), ("b", 0.1)):
        s.add_request(rid, arrival)
        s.add_chunk(rid, chunk(2))
    assert step(s, now=1.0) == [("a", 2), ("b", 2)]  # both new: arrival order
    assert s.requests["a"].deadline == pytest.approx(1.16) and s.requests["b"].deadline == pytest.approx(1.16)
    s.add_chunk("b", chunk(25))
    assert step(s, now=1.1) == [("b", 25)]
    s.add_chunk("a", chunk(25))
    s.add_chunk("b", chunk(25))
    s.add_request("c", 1.15)  # arrived after both started; its player is dry while theirs still play
    s.add_chunk("c", chunk(2))
    assert step(s, now=1.3) == [("c", 2), ("a", 25), ("b", 25)]  # deadlines 1.15, 1.16, 3.16
    assert s.requests["a"].deadline == pytest.approx(1.16 + 2.0)
    assert s.requests["b"].deadline == pytest.approx(1.16 + 4.0)


def test_stream_that_ran_dry_before_a_new_request_arrived_goes_first():
    s = scheduler()
    s.add_request("old", 0.0)
    s.add_chunk("old", chunk(2))
    step(s, now=0.0)                       # old's player runs dry at 0.16
    s.add_request("new", 5.0)
    s.add_chunk("new", chunk(2))
    s.add_chunk("old", chunk(2))
    assert step(s, now=5.1) == [("old", 2), ("new", 2)]


def test_budget_splits_chunks_and_caps_the_batch():
    s = scheduler(max_batch_size=3, frame_budget=16)
    for i in range(5):
        s.add_request(f"r{i}", float(i))
        s.add_chunk(f"r{i}", chunk(25, is_last=True))
    batch = s.schedule()
    assert [(p.request_id, p.num_frames, p.is_last) for p in batch] == [("r0", 16, False)]
    np.testing.assert_array_equal(batch[0].codes, chunk(25).codes[:16])
    s.postprocess(batch, 10.0)
    assert s.requests["r0"].deadline == 0.0  # no audio left yet: a split chunk leaves whole
    batch = s.schedule()
    assert [(p.request_id, p.num_frames, p.is_last) for p in batch] == [("r0", 9, True), ("r1", 7, False)]
    np.testing.assert_array_equal(batch[0].codes, chunk(25).codes[16:])
    s.postprocess(batch, 11.0)
    assert sorted(s.requests) == ["r1", "r2", "r3", "r4"]  # finished requests are forgotten
    s.frame_budget = 1000
    batch = s.schedule()                   # at most 3 requests, each one piece: the rest of its oldest chunk
    assert [(p.request_id, p.num_frames, p.is_last) for p in batch] == [("r1", 18, True), ("r2", 25, True),
                                                                         ("r3", 25, True)]


def test_always_at_least_one_frame_and_budget_respected():
    s = scheduler(frame_budget=1)
    s.add_request("a", 0.0)
    s.add_chunk("a", chunk(3))
    assert [step(s, now) for now in (1.0, 2.0, 3.0, 4.0)] == [[("a", 1)], [("a", 1)], [("a", 1)], []]
    s = scheduler(frame_budget=10)
    for i, frames in enumerate([2, 7, 25, 4]):
        s.add_request(f"r{i}", 0.0)
        s.add_chunk(f"r{i}", chunk(frames))
    assert step(s, 1.0) == [("r0", 2), ("r1", 7), ("r2", 1)]


def test_context_chunks_emit_nothing_and_do_not_start_the_clock():
    s = scheduler(frame_budget=8)
    s.add_request("icl", 3.0)
    s.add_chunk("icl", chunk(20, is_context=True))
    s.add_chunk("icl", chunk(2))
    pieces = []
    for now in (4.0, 5.0, 6.0):
        batch = s.schedule()
        s.postprocess(batch, now)
        pieces += [(p.num_frames, p.chunk.is_context) for p in batch]
        assert s.requests["icl"].deadline == 3.0  # still waiting for its first audio
    batch = s.schedule()
    s.postprocess(batch, 7.0)
    assert pieces + [(p.num_frames, p.chunk.is_context) for p in batch] == [(8, True), (8, True), (4, True), (2, False)]
    assert s.requests["icl"].deadline == pytest.approx(7.0 + 2 * FRAME_SECONDS)


def test_no_starvation_under_a_flood_of_new_requests():
    # Overload: every step brings more first chunks than the budget holds, and the old stream has fallen behind.
    # Requests that arrived after its player ran dry do not hold it back for good, and new ones start in turn.
    s = scheduler(max_batch_size=32, frame_budget=16)
    s.add_request("old", 0.0)
    for _ in range(20):
        s.add_chunk("old", chunk(25))
    served_old, old_steps, arrivals, first_served = 0, [], {}, {}
    for t in range(200):
        now = 0.05 * t
        for k in range(10):                # 10 x 2 frames > the 16-frame budget, every step
            rid = f"n{t}.{k}"
            s.add_request(rid, now)
            s.add_chunk(rid, chunk(2))
            arrivals[rid] = t
        for rid, frames in step(s, now + 0.05):
            if rid == "old":
                served_old += frames
                old_steps.append(t)
            first_served.setdefault(rid, t)
    assert served_old >= 80 and np.diff([0, *old_steps, 199]).max() <= 60  # decoded at least every 60 steps
    waits = [first_served[rid] - arrivals[rid] for rid in first_served if rid != "old"]
    assert len(waits) > 500 and max(waits) < 80


def test_abort_drops_pending_and_split_chunks():
    s = scheduler(frame_budget=4)
    s.add_request("a", 0.0)
    s.add_request("b", 0.0)
    s.add_chunk("a", chunk(10))
    s.add_chunk("b", chunk(2))
    assert step(s, 1.0) == [("a", 4)]      # a is mid-chunk
    assert s.abort("a") and not s.abort("a")
    assert not s.add_chunk("a", chunk(2))
    assert step(s, 2.0) == [("b", 2)]
    assert not s.has_work()
    assert step(s, 3.0) == []


def test_lanes_fill_in_deadline_order_each_within_the_budget():
    s = scheduler(max_batch_size=8, frame_budget=4, lanes=2)
    for i, frames in enumerate([1, 25, 2, 2, 9]):
        s.add_request(f"r{i}", float(i))
        s.add_chunk(f"r{i}", chunk(frames))
    batch = s.schedule()
    assert [(p.request_id, p.num_frames, p.lane) for p in batch] == [
        ("r0", 1, 0), ("r1", 3, 0), ("r2", 2, 1), ("r3", 2, 1)]   # r4 waits: both lanes' budgets are spent
    s.postprocess(batch, 10.0)
    batch = s.schedule()                   # r1's deadline is still its arrival (its chunk is not done): first
    assert [(p.request_id, p.num_frames, p.lane) for p in batch] == [("r1", 4, 0), ("r4", 4, 1)]
    one_lane = scheduler(max_batch_size=8, frame_budget=4, lanes=1)
    one_lane.add_request("a", 0.0)
    one_lane.add_request("b", 1.0)
    one_lane.add_chunk("a", chunk(4))
    one_lane.add_chunk("b", chunk(4))
    assert step(one_lane, 1.0) == [("a", 4)]


# ------------------------------------------------------------------------------------------------------------
# Engine: scheduled, split, batched streaming decode == one-pass decode per request
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder() -> SpeechDecoder:
    variant = FIXTURES / "tiny-custom-voice"
    cfg = SpeechTokenizerConfig.load(str(variant)).decoder
    return load_component(lambda: SpeechDecoder(cfg), variant / "speech_tokenizer", "decoder.")


@pytest.mark.parametrize("frame_budget,lanes,static", [(None, 1, False), (3, 1, False), (16, 1, False), (3, 2, False),
                                                       (5, 3, False), (None, 1, True), (16, 1, True)])
def test_engine_audio_equals_one_pass_decode(decoder, frame_budget, lanes, static):
    """Streams at staggered offsets, chunks split by the budget, ICL context, lanes at once; static: the runner's
    bucketed rows and frame sizes (what CUDA graphs replay), run eagerly."""
    rng = np.random.default_rng(0)
    schedules = [[2, 25, 25, 3], [1, 7], [25], [2, 25, 0], [5, 5, 5, 5, 5], [2, 9, 25, 25, 1], [3], [2, 14, 25, 8],
                 [2, 2, 2], [25, 25], [6, 1, 1, 1], [2, 25, 25, 25]]
    context = {1: 11, 7: 30}               # ICL requests: reference codes first, decoded but not emitted
    engine = Code2WavEngine(decoder, max_batch_size=4, frame_budget=frame_budget, lanes=lanes,
                            runner=Code2WavRunner(decoder, 4, capacity=2, static_shapes=static))
    codes = {i: rng.integers(0, decoder.cfg.codebook_size, (context.get(i, 0) + sum(s), 16))
             for i, s in enumerate(schedules)}
    queued = {i: 0 for i in codes}
    audio = {f"r{i}": [] for i in codes}
    sent_frames = {f"r{i}": [] for i in codes}
    finished = set()
    t = 0
    while len(finished) < len(codes):
        for i, sizes in enumerate(schedules):
            if t == 2 * i:                 # staggered arrivals
                engine.add_request(f"r{i}")
                if i in context:
                    engine.add_chunk(f"r{i}", CodecChunk(codes[i][:context[i]], is_context=True))
                    queued[i] = context[i]
            k = t - 2 * i                  # then one chunk per step
            if 0 <= k < len(sizes):
                engine.add_chunk(f"r{i}", CodecChunk(codes[i][queued[i]:queued[i] + sizes[k]],
                                                     is_last=k == len(sizes) - 1))
                queued[i] += sizes[k]
        if engine.has_work():
            for out in engine.step():
                assert out.request_id not in finished
                audio[out.request_id].append(out.audio)
                sent_frames[out.request_id].append(len(out.audio) // decoder.samples_per_frame)
                if out.finished:
                    finished.add(out.request_id)
        t += 1
        assert t < 1000
    assert finished == set(audio) and not engine.requests and not engine.has_work()
    for i, c in codes.items():
        assert sent_frames[f"r{i}"] == schedules[i]  # split chunks leave whole: the talker's chunking, unchanged
        full = decoder(torch.from_numpy(c.T[None].astype(np.int64)))[0].numpy()
        expected = full[context.get(i, 0) * decoder.samples_per_frame:]
        got = np.concatenate(audio[f"r{i}"])
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [np.full((3, 16), 2048), np.full((3, 16), -1), np.zeros((3, 8), np.int64)])
def test_engine_refuses_codes_the_decoder_cannot_look_up(decoder, bad):
    """Refused when queued, so a bad chunk never reaches a decoder call shared with other requests."""
    engine = Code2WavEngine(decoder, max_batch_size=4)
    engine.add_request("good")
    engine.add_request("bad")
    with pytest.raises(ValueError, match="codes"):
        engine.add_chunk("bad", CodecChunk(bad, is_last=True))
    engine.abort("bad")
    engine.add_chunk("good", CodecChunk(np.full((3, 16), decoder.cfg.codebook_size - 1), is_last=True))
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.audio.size) for o in outputs] == [("good", True, 3 * decoder.samples_per_frame)]


def test_calibration_returns_a_positive_budget_within_its_time_cap(decoder, monkeypatch):
    budget = measure_frame_budget(Code2WavRunner(decoder, 32), chunk_frames=25, max_rows=32)
    assert isinstance(budget, int) and 1 <= budget <= 32 * 25
    # the cap, by what it does: with no time left after the first size, nothing bigger is measured
    monkeypatch.setattr(code2wav_engine, "MAX_CALIBRATION_SECONDS", 0.0)
    assert measure_frame_budget(Code2WavRunner(decoder, 32), chunk_frames=25, max_rows=32) == 1


# ------------------------------------------------------------------------------------------------------------
# Stage
# ------------------------------------------------------------------------------------------------------------
def test_code2wav_stage_loads_the_speech_decoder_alone(tmp_path):
    """A model directory holding only speech_tokenizer/ (no config.json, no text tokenizer, no talker weights)
    starts the code2wav stage: it loads nothing else."""
    shutil.copytree(FIXTURES / "tiny-custom-voice" / "speech_tokenizer", tmp_path / "speech_tokenizer")
    with RingOwner.create(num_slots=4, max_frames=25, edge="c2w") as ring, zmq.Context() as ctx:
        events = ctx.socket(zmq.PULL)
        events.setsockopt(zmq.RCVTIMEO, 120_000)  # a stage that died silently fails the test instead of hanging it
        events.bind(f"ipc://{tmp_path}/events")
        pipeline = PipelineConfig(stages=StagesConfig(talker=TalkerStageConfig(device="cpu"),
                                                      code2wav=Code2WavStageConfig(device="cpu", frame_budget=4)))
        launch = StageLaunch(stage="code2wav", model_dir=str(tmp_path), pipeline=pipeline, max_batch_size=2,
                             threads=1, command_address=f"ipc://{tmp_path}/code2wav",
                             event_address=f"ipc://{tmp_path}/events", connector=ring.spec)
        process = multiprocessing.get_context("spawn").Process(target=code2wav_stage.main,
                                                               args=(msgspec.msgpack.encode(launch),))
        process.start()
        commands = ctx.socket(zmq.PUSH)
        commands.connect(launch.command_address)
        try:
            decoder = msgspec.msgpack.Decoder(StageEvent)
            first = decoder.decode(events.recv())
            while isinstance(first, Heartbeat):
                first = decoder.decode(events.recv())
            assert isinstance(first, Ready), first
            commands.send(msgspec.msgpack.encode(Shutdown()))
            process.join(30)
            assert process.exitcode == 0
        finally:
            process.kill()
            events.close(linger=0)
            commands.close(linger=0)
