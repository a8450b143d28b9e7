"""Base voice features beside the talker's step loop (stages/voice_features.py): exactness, one computation per
identical clip in a batch, the per-voice cache, cancellation, errors, and a real TalkerStage whose running streams
keep their pace while a request with a 10 s reference clip is admitted."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from conftest import FIXTURES
from omni_tts.config import load_stage_config
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.audio import load_audio_24k
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams, resolve_sampling
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.stages.messages import Abort, AddRequest, FailureKind, RequestFailure, TalkerDone
from omni_tts.stages.voice_features import FeatureJob, VoiceFeatureCache, VoiceFeatures, VoiceFeatureWorker
from stage_harness import StageHarness
from waiting import eventually

TINY_BASE = FIXTURES / "tiny-base"
REF_TEXT = (FIXTURES / "ref_voice.txt").read_text().strip()
CLIP = load_audio_24k(str(FIXTURES / "ref_voice.wav")).astype(np.float32)          # 3.4 s
LONG_CLIP, LONG_TEXT = np.tile(CLIP, 3), " ".join([REF_TEXT] * 3)                   # 10.3 s
LONG_INPUT = "A long sentence to keep the stream going for a while, with a pause or two, and then some more words."


@pytest.fixture(scope="module")
def tts() -> Qwen3TTS:
    return Qwen3TTS(str(TINY_BASE), with_decoder=False)


def add_request(tts: Qwen3TTS, rid: str, clip: np.ndarray | None = CLIP, ref_text: str | None = None,
                voice_version: str | None = None, text: str = "Hello there.", max_tokens: int = 40,
                temperature: float = 0.9, seed: int = 1) -> AddRequest:
    request = SynthesisRequest(text=text, language="english", ref_audio=(CLIP, 24000), ref_text=ref_text,
                               x_vector_only=ref_text is None,
                               sampling=SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_tokens))
    p = tts.prompts.tokenize(request)
    return AddRequest(request_id=rid, prompt=p, sampling=resolve_sampling(request.sampling, tts.generation_config),
                      max_tokens=max_tokens, ref_audio=None if clip is None else clip.tobytes(),
                      voice_version=voice_version)


def job(tts: Qwen3TTS, rid: str, **kwargs) -> FeatureJob:
    return FeatureJob(add_request(tts, rid, **kwargs))


class CountingTTS:
    """The model, counting (and optionally holding back) voice-feature computations."""

    def __init__(self, tts: Qwen3TTS) -> None:
        self.tts, self.device, self.calls = tts, tts.device, 0
        self.gate = threading.Event()
        self.gate.set()

    def add_voice_features(self, prompt, ref_audio) -> None:
        self.calls += 1
        self.gate.wait()
        self.tts.add_voice_features(prompt, ref_audio)


def wait_finished(worker: VoiceFeatureWorker, count: int) -> list[FeatureJob]:
    """The next `count` jobs the worker hands back."""
    done: list[FeatureJob] = []

    def taken() -> bool:
        done.extend(worker.take_finished())
        return len(done) >= count
    eventually(taken, what=lambda: f"{count} jobs finished ({len(done)} did)")
    return done


@pytest.fixture
def worker(tts):
    model = CountingTTS(tts)
    w = VoiceFeatureWorker(model, threading.Condition(), VoiceFeatureCache(max_entries=2))
    yield w
    model.gate.set()
    w.close()


# --- the worker --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref_text", [None, REF_TEXT], ids=["x_vector", "icl"])
def test_features_equal_the_inline_computation(tts, worker, ref_text):
    j = job(tts, "r", ref_text=ref_text)
    worker.submit(j)
    [done] = wait_finished(worker, 1)
    assert done is j and done.failure is None and done.request.prompt.speaker_embedding is None  # the loop applies them
    done.features.apply(done.request.prompt)
    expected = job(tts, "e", ref_text=ref_text).request.prompt
    tts.add_voice_features(expected, (CLIP, 24000))
    assert torch.equal(done.request.prompt.speaker_embedding, expected.speaker_embedding)
    assert (done.request.prompt.ref_codes is None) == (ref_text is None)
    if ref_text is not None:
        assert torch.equal(done.request.prompt.ref_codes, expected.ref_codes)


def test_identical_clips_in_one_batch_are_computed_once(tts, worker):
    jobs = [job(tts, "a"), job(tts, "b", ref_text=REF_TEXT), job(tts, "c", clip=LONG_CLIP)]
    with worker.condition:  # all queued before the thread can take any: one batch
        for j in jobs:
            worker.submit(j)
    done = wait_finished(worker, 3)
    assert {d.request.request_id for d in done} == {"a", "b", "c"} and worker.tts.calls == 2
    a, b, c = jobs
    assert a.features is b.features and c.features is not a.features
    for j in jobs:
        j.features.apply(j.request.prompt)
    assert a.request.prompt.ref_codes is None and b.request.prompt.ref_codes is not None  # x-vector-only stays x-vector-only


def test_cache_is_per_voice_version_and_bounded(tts, worker):
    cache = worker.cache
    worker.submit(job(tts, "a", voice_version="fox@1.0"))
    wait_finished(worker, 1)
    assert cache.get("fox@1.0", icl=False) is not None
    assert cache.get("fox@1.0", icl=True) is None              # x-vector only so far: ICL needs the codes
    assert cache.get("fox@2.0", icl=False) is None             # another version of the voice
    worker.submit(job(tts, "b", ref_text=REF_TEXT, voice_version="fox@1.0"))
    wait_finished(worker, 1)
    icl = cache.get("fox@1.0", icl=True)
    assert icl is not None and icl.ref_codes is not None
    worker.submit(job(tts, "c", voice_version="fox@1.0"))           # the worker itself hits the cache
    wait_finished(worker, 1)
    assert worker.tts.calls == 2 and cache.get("fox@1.0", icl=True) is icl  # ICL codes are kept
    features = VoiceFeatures(icl.speaker_embedding, None)
    cache.put("owl@1.0", features)
    cache.put("cat@1.0", features)
    assert cache.get("fox@1.0", icl=False) is None  # least recently used went first
    assert cache.get("owl@1.0", icl=False) is features and cache.get("cat@1.0", icl=False) is features


def test_cancelled_jobs_are_never_handed_back(tts, worker):
    worker.tts.gate.clear()
    worker.submit(job(tts, "running"))
    eventually(lambda: worker.tts.calls == 1, what="the first job computing")
    worker.submit(job(tts, "queued"))
    worker.cancel("running")
    worker.cancel("queued")
    worker.submit(job(tts, "after"))
    worker.tts.gate.set()
    assert [d.request.request_id for d in wait_finished(worker, 1)] == ["after"]
    # one thread, jobs in order: "after" came back, so the worker is past the cancelled ones, with nothing queued
    with worker.condition:
        assert not worker.has_finished() and not worker._live and not worker._queue
    assert worker.tts.calls == 2  # "queued" was dropped before it ran


def test_a_bad_clip_fails_alone(tts, worker):
    bad, good = job(tts, "bad", clip=CLIP[:100]), job(tts, "good", clip=LONG_CLIP)
    with worker.condition:
        worker.submit(bad)
        worker.submit(good)
    wait_finished(worker, 2)
    assert is_bad_input(bad.failure, "ref_audio", "too short") and bad.features is None
    assert good.failure is None and good.features is not None


def is_bad_input(failure: RequestFailure | None, param: str, says: str) -> bool:
    """The request's own fault, naming `param`, saying `says`: the orchestrator answers it 400 and never retries."""
    return (failure is not None and failure.kind is FailureKind.BAD_INPUT and failure.param == param
            and says in failure.message)


@pytest.fixture
def stage():
    harness = StageHarness()
    yield harness
    harness.close()


def start_streams(tts: Qwen3TTS, stage: StageHarness) -> None:
    """Six Base streams running in the stage (sampled: some end early, enough run on)."""
    for i in range(6):
        stage.send(add_request(tts, f"run{i}", voice_version=f"v{i}", text=LONG_INPUT, max_tokens=2000, seed=i))
    eventually(lambda: all(stage.received(f"run{i}") for i in range(6)), what="six streams running")


def test_stage_admission_does_not_stall_running_streams(tts, stage):
    """Held by state: while a request's 10 s ICL reference clip is in the feature worker (its computation gated),
    the step loop goes on making the running streams' frames (inline, the loop would wait with it)."""
    stage.stage.voice_features.tts = gated = CountingTTS(tts)
    start_streams(tts, stage)
    computed = gated.calls
    gated.gate.clear()
    stage.send(add_request(tts, "new", clip=LONG_CLIP, ref_text=LONG_TEXT, text=LONG_INPUT, max_tokens=2000))
    eventually(lambda: gated.calls == computed + 1, what="the new request's features in the worker")
    held_from = len(stage.log.ends)
    eventually(lambda: len(stage.log.ends) >= held_from + 20, what="20 steps while its features are held")
    assert min(stage.log.frames[held_from:held_from + 20]) >= 2, "too few streams ran meanwhile"
    assert not stage.received("new")
    gated.gate.set()
    eventually(lambda: stage.received("new"), what="the new request admitted once its features are there")


@pytest.mark.slow
def test_stage_admission_keeps_the_step_pace(tts, stage):
    """Measured (a wall-clock check, opt-in): while Base streams run, a request with a 10 s ICL reference clip is
    admitted and no gap between steps grows past one median step (inline, the features' whole time would sit in
    one such gap)."""
    start_streams(tts, stage)
    warm = len(stage.log.ends)
    eventually(lambda: len(stage.log.ends) >= warm + 20, what="20 more steps")
    before = len(stage.log.ends)
    submitted = time.perf_counter()
    stage.send(add_request(tts, "new", clip=LONG_CLIP, ref_text=LONG_TEXT, text=LONG_INPUT, max_tokens=2000))
    eventually(lambda: stage.received("new"), what="the new request admitted", interval=0.005)
    admitted = time.perf_counter()
    eventually(lambda: stage.log.ends[-1] > admitted + 0.05, what="steps after the admission", interval=0.005)
    n = len(stage.log.ends)
    starts, ends = np.array(stage.log.starts[:n]), np.array(stage.log.ends)
    durations = ends - starts
    median_step = float(np.median(durations[warm:before]))
    window = (starts[1:] > submitted) & (ends[:-1] < admitted)
    gaps = starts[1:][window] - ends[:-1][window]
    intervals = np.diff(starts)[window]
    assert min(np.array(stage.log.frames[1:n])[window]) >= 2, "too few streams ran through the admission"
    print(f"\nmedian step {median_step * 1e3:.2f} ms; during the {(admitted - submitted) * 1e3:.0f} ms admission "
          f"({window.sum()} steps): max gap between steps {gaps.max() * 1e3:.2f} ms, "
          f"max step-to-step interval {intervals.max() * 1e3:.2f} ms")
    assert admitted - submitted > 2 * median_step, "the features took too little time to show anything"
    assert gaps.max() <= median_step


def test_stage_icl_context_precedes_frames_and_cached_voice_skips_worker(tts, stage, monkeypatch):
    stage.send(add_request(tts, "a", ref_text=REF_TEXT, voice_version="fox@1.0"))
    assert stage.next_event(TalkerDone).failure is None
    calls = []
    monkeypatch.setattr(stage.stage.voice_features, "submit", calls.append)
    stage.send(add_request(tts, "b", ref_text=REF_TEXT, voice_version="fox@1.0"))
    assert stage.next_event(TalkerDone).request_id == "b" and calls == []
    for rid in ("a", "b"):
        eventually(lambda: any(last for _, _, last in stage.received(rid)), what=f"{rid}'s last chunk")
        chunks = stage.received(rid)
        assert [seq for seq, _, _ in chunks] == list(range(len(chunks)))
        contexts = [ctx for _, ctx, _ in chunks]
        assert contexts[0] and not contexts[-1] and contexts == sorted(contexts, reverse=True)  # context, then frames


def test_stage_abort_while_in_worker_and_error_fail_alone(tts, stage):
    stage.stage.voice_features.tts = gated = CountingTTS(tts)
    gated.gate.clear()
    stage.send(add_request(tts, "aborted", clip=LONG_CLIP))
    eventually(lambda: gated.calls == 1, what="its features computing")
    stage.send(Abort("aborted"))
    stage.send(add_request(tts, "bad", clip=CLIP[:100]))
    stage.send(add_request(tts, "good"))
    eventually(lambda: "aborted" not in stage.stage.voice_features._live, what="the abort taken")
    gated.gate.set()
    done = {}
    while len(done) < 2:
        event = stage.next_event(TalkerDone)
        done[event.request_id] = event
    assert is_bad_input(done["bad"].failure, "ref_audio", "too short") and done["good"].failure is None
    # the worker hands jobs back in order, so an admitted "aborted" would run beside "good": by good's last chunk
    # it would have chunks and be in the stats (a round trip through the loop, after its events)
    eventually(lambda: any(last for _, _, last in stage.received("good")), what="good's last chunk")
    assert "aborted" not in stage.stats().request_ids
    assert not stage.received("aborted") and not stage.other_events


def test_stage_input_errors_are_bad_input_naming_the_field(tts, stage):
    """What only the stage can find is the request's fault, typed where it is found, and fails it alone: a clip whose
    x-vector is no usable one (samples far outside [-1, 1] overflow the mel spectrogram into NaN), and a sent
    x-vector of another size (checked before it is sent; the stage checks what crosses the process boundary)."""
    loud = add_request(tts, "loud", clip=CLIP * np.float32(1e20))
    vector = msgspec.structs.replace(add_request(tts, "vector", clip=None),
                                     speaker_embedding=np.ones(3, np.float32).tobytes())
    for request in (loud, vector, add_request(tts, "good")):
        stage.send(request)
    done = {}
    while len(done) < 3:
        event = stage.next_event(TalkerDone)
        done[event.request_id] = event
    assert is_bad_input(done["loud"].failure, "ref_audio", "no usable speaker embedding")
    assert is_bad_input(done["vector"].failure, "speaker_embedding", "list of 64 numbers")
    assert done["good"].failure is None and done["good"].num_frames > 0


# --- through the orchestrator ------------------------------------------------------------------------------------
def test_cached_voice_gives_the_offline_audio():
    """A voice key's first use (worker) and later uses (cache; ICL entry serving an x-vector-only request too)
    all equal offline synthesis, and so does the clip given as 24 kHz samples (as the server passes what it
    decoded)."""
    def request(x_vector_only: bool) -> SynthesisRequest:
        return SynthesisRequest(text="Clone me.", language="english", ref_audio=(CLIP, 24000), ref_text=REF_TEXT,
                                x_vector_only=x_vector_only, sampling=SamplingParams(temperature=0, max_new_tokens=30))

    offline = Qwen3TTS.from_pretrained(str(TINY_BASE))
    expected = {x: synthesize(offline, [request(x)])[0].audio for x in (False, True)}

    async def main() -> None:
        async with AsyncTTS(str(TINY_BASE), load_stage_config("cpu_tiny")) as engine:
            for x_vector_only in (False, False, True):
                chunks = [c async for c in engine.generate(request(x_vector_only), voice_version="fox@1.0")]
                audio = np.concatenate([c.audio for c in chunks])
                np.testing.assert_allclose(audio, expected[x_vector_only], atol=1e-5, rtol=0)
            samples = dataclasses.replace(request(False), ref_audio=CLIP)
            audio = np.concatenate([c.audio async for c in engine.generate(samples)])
            np.testing.assert_allclose(audio, expected[False], atol=1e-5, rtol=0)

    asyncio.run(main())
