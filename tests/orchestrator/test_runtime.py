"""The two-stage runtime with real processes, real shared memory and real sockets (issue: streaming runtime); a few
cases again with the TCP connector between the stages (connector.kind: tcp, on loopback) and with both stages in
one process (connector.kind: local, the fused layout). The tiny CustomVoice pipeline over shared memory is started
once for the module (a start is seconds); each test leaves it holding nothing."""
import asyncio
import contextlib
import os

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import zmq

from conftest import FIXTURES, GOLDEN_CASES, RUNS_TO_ITS_LIMIT, case_requests, stage_config
from test_supervision import forge_chunk
from omni_tts.config import load_stage_config
from omni_tts.connectors import RingSpec, TcpSpec
from omni_tts.connectors.local import LocalSpec
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.types import RequestFailed, RequestTimedOut
from omni_tts.stages.messages import Register, TalkerDone
from waiting import SHARED_PIPELINE, eventually_async

VOICES = ["ryan", "vivian", "serena", "aiden", "sohee", "uncle_fu", "ono_anna", "dylan", "eric"]
TEXTS = ["Hi.", "Good morning, everyone.", "今天天气很好。", "A somewhat longer sentence, with a pause or two.",
         "Numbers like 42 and 2026 are read aloud.", "混合 mixed 文本 text."]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    async with AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny"),
                        **SHARED_PIPELINE) as engine:
        yield engine


@contextlib.asynccontextmanager
async def pipeline(shared: AsyncTTS, variant: str, kind: str):
    """The module's pipeline for tiny-custom-voice over shm, else one of `variant` over the `kind` connector."""
    if (variant, kind) == ("tiny-custom-voice", "shm"):
        yield shared
        return
    # over tcp, code2wav measures its frame budget at start (cpu_tiny sets one): streamed still equals offline
    async with AsyncTTS(str(FIXTURES / variant), stage_config(kind, measured_frame_budget=kind == "tcp")) as engine:
        yield engine


async def collect(engine, request, **kwargs):
    chunks = [c async for c in engine.generate(request, **kwargs)]
    return np.concatenate([c.audio for c in chunks]), chunks[-1].usage, chunks


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def assert_connector(engine: AsyncTTS, kind: str) -> None:
    assert isinstance(engine.connector_spec, {"shm": RingSpec, "tcp": TcpSpec, "local": LocalSpec}[kind])
    pids = engine.stage_pids()
    assert (pids["talker"] == pids["code2wav"]) == (kind == "local")


def many_requests(n, max_new_tokens=40):
    return [SynthesisRequest(text=TEXTS[i % len(TEXTS)], voice=VOICES[i % len(VOICES)], language="auto",
                             sampling=SamplingParams(temperature=0 if i % 3 else 0.8, seed=i,
                                                     max_new_tokens=max_new_tokens - (i % 5) * 6))
            for i in range(n)]


# tcp and local once, on Base: its ICL requests send reference-context chunks too
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("variant,kind", [("tiny-custom-voice", "shm"), ("tiny-voice-design", "shm"),
                                          ("tiny-base", "shm"), ("tiny-base", "tcp"), ("tiny-base", "local")])
async def test_streamed_equals_offline_for_first_chunk_sizes(engine, variant, kind):
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    requests = [r for c in GOLDEN_CASES if c["variant"] == variant for r in case_requests(c)][:3]
    offline = [synthesize(tts, [r])[0] for r in requests]
    async with pipeline(engine, variant, kind) as engine:
        assert_connector(engine, kind)
        for initial in (1, 2, 25):
            results = await asyncio.gather(*(collect(engine, r, initial_codec_chunk_frames=initial) for r in requests))
            for (audio, usage, chunks), expected in zip(results, offline):
                assert audio.shape == expected.audio.shape
                np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)
                assert usage.output_frames == expected.codes.shape[0]
                assert usage.finish_reason == expected.finish_reason
                assert chunks[0].audio.shape[0] == min(initial, expected.codes.shape[0]) * 1920


@pytest.mark.asyncio(loop_scope="module")
async def test_24_concurrent_requests_each_get_their_own_audio(engine):
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    requests = many_requests(24)
    offline = synthesize(tts, requests)  # a batch gives each request what it gives alone (test_synthesize)
    chunks_before = (await engine.stats())["code2wav"].connector_chunks
    results = await asyncio.gather(*(collect(engine, r, request_id=f"req-{i}") for i, r in enumerate(requests)))
    for (audio, usage, _), expected in zip(results, offline):
        assert audio.dtype == np.float32 and audio.shape == expected.audio.shape
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)
        assert usage.output_frames == expected.codes.shape[0]
    stats = await engine.stats()
    assert stats["talker"].request_ids == [] and stats["code2wav"].request_ids == []
    ring = stats["code2wav"]
    latencies = ring.connector_latencies
    assert ring.connector_chunks >= chunks_before + 24 and sum(latencies.counts) == ring.connector_chunks
    assert 0 < latencies.sum / ring.connector_chunks < 60  # seconds (not ns): a unit check, not a speed one
    for stage in stats.values():  # every engine step timed once
        assert sum(stage.step_durations.counts) == stage.num_steps > 0
    # callers at once (/metrics and /health): each gets both stages' answers (a stage answers by its name)
    for answer in await asyncio.gather(*(engine.stats(timeout=30) for _ in range(3))):
        assert set(answer) == {"talker", "code2wav"}


@pytest.mark.asyncio(loop_scope="module")
async def test_cancelled_requests_are_freed_in_both_stages(engine):
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    requests = many_requests(20, max_new_tokens=60)
    cancelled = {1, 4, 8, 13, 17}
    for i in cancelled:  # 191 frames each: cancelled at their first audio, they cannot have ended
        requests[i] = SynthesisRequest(text=RUNS_TO_ITS_LIMIT, voice="ryan", sampling=SamplingParams(
            temperature=0, repetition_penalty=1.0, max_new_tokens=2000))
    offline = synthesize(tts, requests)
    started = {i: asyncio.Event() for i in cancelled}

    async def run_one(i, r):
        chunks = []
        async for chunk in engine.generate(r, request_id=f"req-{i}"):
            chunks.append(chunk)
            if i in started:
                started[i].set()
        return np.concatenate([c.audio for c in chunks])
    tasks = [asyncio.create_task(run_one(i, r)) for i, r in enumerate(requests)]
    for i in cancelled:
        await asyncio.wait_for(started[i].wait(), 60)
        tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, (result, expected) in enumerate(zip(results, offline)):
        if i in cancelled:
            assert isinstance(result, asyncio.CancelledError), result
            continue
        np.testing.assert_allclose(result, expected.audio, atol=1e-5, rtol=0)
    stats = await engine.stats()
    for stage in ("talker", "code2wav"):
        assert stats[stage].request_ids == [], (stage, stats[stage].request_ids)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("kind", ["shm", "tcp", "local"])
async def test_bad_requests_fail_alone_and_idle_stages_use_no_cpu(engine, kind):
    async with pipeline(engine, "tiny-custom-voice", kind) as engine:
        assert_connector(engine, kind)
        with pytest.raises(RequestError, match="unknown voice"):
            await collect(engine, SynthesisRequest(text="Hi.", voice="nobody"))
        with pytest.raises(RequestError, match="initial_codec_chunk_frames"):
            await collect(engine, many_requests(1)[0], initial_codec_chunk_frames=0)
        restarts = dict(engine.restarts)
        with pytest.raises(RequestError, match="longer than 64 UTF-8 bytes"):  # a chunk header's room
            await collect(engine, many_requests(1)[0], request_id="é" * 33)
        running = engine.generate(SynthesisRequest(text=RUNS_TO_ITS_LIMIT, voice="ryan"), request_id="twice")
        await anext(running)  # in flight
        with pytest.raises(RequestError, match="already in flight"):
            await collect(engine, many_requests(1)[0], request_id="twice")
        await running.aclose()
        assert engine.restarts == restarts
        audio, usage, _ = await collect(engine, many_requests(1)[0])
        assert usage.output_frames > 0 and audio.shape[0] == usage.output_frames * 1920
        before = await engine.stats()
        await asyncio.sleep(2.0)  # a window to measure over, not a wait: nothing is to happen in it
        after = await engine.stats()
        for stage in ("talker", "code2wav"):
            busy = (after[stage].cpu_seconds - before[stage].cpu_seconds) / 2.0
            print(f"idle CPU {stage}: {busy * 100:.2f}%")
            assert busy < 0.05, (stage, busy)


@pytest.mark.asyncio(loop_scope="module")
async def test_chunks_of_unknown_requests_get_no_decoder_state(engine):
    """A connector chunk whose request code2wav has not registered gets no decoder state (one from a stray writer
    would otherwise hold it until an end marker that never comes): it waits for its Register, sent before the talker
    gets the request but on another socket, and is decoded once that comes; one whose Register does not come is
    dropped and counted."""
    before = (await engine.stats())["code2wav"]

    async def taken(num_chunks):
        stats = (await engine.stats())["code2wav"]
        return stats.connector_chunks >= before.connector_chunks + num_chunks and stats

    forge_chunk(engine, "stray", np.zeros((4, 16), np.int32))
    assert (await eventually_async(lambda: taken(1), what="the stray chunk taken")).request_ids == []
    forge_chunk(engine, "early", np.ones((4, 16), np.int32))
    assert (await eventually_async(lambda: taken(2), what="the early chunk taken")).request_ids == []
    state = engine.client.add("early", 0)
    await engine.client.send(state, "code2wav", Register("early"))
    chunk = await asyncio.wait_for(anext(engine.client.outputs(state)), 30)
    assert chunk.audio.shape[0] == 4 * 1920  # its early chunk, decoded
    await engine.client.release(state)

    async def stray_dropped():
        stats = (await engine.stats())["code2wav"]
        assert "stray" not in stats.request_ids
        return stats.unknown_chunks > before.unknown_chunks and stats
    stats = await eventually_async(stray_dropped, what="the stray chunk dropped")
    assert stats.unknown_chunks == before.unknown_chunks + 1 and stats.request_ids == []
    audio, usage, _ = await collect(engine, many_requests(1)[0])  # the stage serves on
    assert audio.shape[0] == usage.output_frames * 1920 > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lost_chunk_fails_its_request_at_once_and_a_lost_last_chunk_soon(engine):
    """Chunks carry their seq end to end: a gap fails the request (its audio would skip frames); and once stage 0
    reported its last frame, audio that stops coming (its last chunk lost) fails the request within
    last_audio_timeout, not after its whole deadline."""
    gap = engine.client.add("gap", 0)
    await engine.client.send(gap, "code2wav", Register("gap"))
    outputs = engine.client.outputs(gap)
    forge_chunk(engine, "gap", np.ones((4, 16), np.int32), seq=0)
    assert (await asyncio.wait_for(anext(outputs), 30)).audio.shape[0] == 4 * 1920
    forge_chunk(engine, "gap", np.ones((4, 16), np.int32), seq=2)
    with pytest.raises(RequestFailed, match="lost chunk 1 of its codes"):
        await asyncio.wait_for(anext(outputs), 30)
    await engine.client.release(gap)

    timeout, engine.client.last_audio_timeout = engine.client.last_audio_timeout, 0.5
    try:
        lost = engine.client.add("lost-last", 0)
        await engine.client.send(lost, "code2wav", Register("lost-last"))
        outputs = engine.client.outputs(lost)
        forge_chunk(engine, "lost-last", np.ones((4, 16), np.int32), seq=0)
        assert (await asyncio.wait_for(anext(outputs), 30)).audio.shape[0] == 4 * 1920
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:  # stage 0's report: 8 frames, chunk 1 never comes
            sock.connect(engine.event_address)
            sock.send(msgspec.msgpack.encode(TalkerDone("lost-last", 8, "stop")))
            sock.close(linger=1000)
        with pytest.raises(RequestTimedOut, match="no audio for 0.5 s after its last frame was made"):
            await asyncio.wait_for(anext(outputs), 30)
        await engine.client.release(lost)
    finally:
        engine.client.last_audio_timeout = timeout
    stats = await eventually_async(lambda: _holding_nothing(engine), what="both stages holding nothing")
    assert stats["code2wav"].request_ids == []


async def _holding_nothing(engine):
    stats = await engine.stats()
    return all(not s.request_ids for s in stats.values()) and stats


@pytest.mark.asyncio(loop_scope="module")
async def test_a_failed_requests_abort_is_held_until_it_ran(engine):
    """The loop keeps only a weak reference to a task: the abort that a failure starts is held by the client until
    it is done, and then let go."""
    state = engine.client.add("failing", 1)
    engine.client.fail(state, RequestFailed("a stage refused it"))
    [abort] = engine.client.pending_aborts
    await abort
    assert not engine.client.pending_aborts and "failing" not in engine.requests
    with pytest.raises(RequestFailed, match="a stage refused it"):
        await anext(engine.client.outputs(state))
