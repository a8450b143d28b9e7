"""AsyncTTS.open_text_stream with real stage processes: text appended in pieces, with pauses, gives the whole
text's audio; its failures (limits, idle, abort) end it in both stages. One tiny CustomVoice pipeline serves the
module's CustomVoice tests (a start is seconds); each leaves it holding nothing."""
import asyncio
import os
import random
import signal

import numpy as np
import pytest
import pytest_asyncio

from conftest import FIXTURES
from omni_tts.config import load_stage_config
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.types import RequestTimedOut, StageDeadError
from test_supervision import wait_until_no_stage_holds_requests
from waiting import RESTART_TIMEOUT, SHARED_PIPELINE, eventually_async

SAMPLES_PER_FRAME = 1920  # 24 kHz at 12.5 frames per second
TEXT = "Hello there! This sentence streams in, a few characters at a time, with a pause or two."
# greedy, this text's row speaks it and then waits for more (it does not end on its own)
RUNS_OUT_OF_TEXT = "Hello there, this row runs out of text "


def request(text: str = "", **kwargs) -> SynthesisRequest:
    kwargs = kwargs or {"voice": "vivian"}
    return SynthesisRequest(text=text, non_streaming_mode=False,
                            sampling=SamplingParams(temperature=0, max_new_tokens=60), **kwargs)


async def parked(engine: AsyncTTS) -> bool:
    """One talker row has spoken its text so far and waits for more."""
    return (await engine.stats())["talker"].rows_waiting_for_text == 1


async def whole(engine: AsyncTTS, text: str, **kwargs) -> np.ndarray:
    return np.concatenate([c.audio async for c in engine.generate(request(text, **kwargs))])


async def streamed(engine: AsyncTTS, pieces: list[str], delays: list[float], voice: dict | None = None,
                   **kwargs):
    async with await engine.open_text_stream(request(**(voice or {})), **kwargs) as stream:
        async def feed():
            for piece, delay in zip(pieces, delays):
                await asyncio.sleep(delay)
                await stream.append(piece)
            await stream.finish()
        feeding = asyncio.create_task(feed())
        try:
            chunks = [c async for c in stream]
        finally:
            await asyncio.gather(feeding, return_exceptions=True)
    return np.concatenate([c.audio for c in chunks]), chunks[-1].usage


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    async with AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny"),
                        **SHARED_PIPELINE) as engine:
        yield engine


def cut(rng: random.Random, text: str) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), 8))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@pytest.mark.asyncio(loop_scope="module")
async def test_pieces_with_pauses_give_the_whole_texts_audio_and_failures_free_the_stages(engine):
    expected = await whole(engine, TEXT)
    rng = random.Random(3)
    runs = [streamed(engine, cut(rng, TEXT), [rng.choice([0, 0.01, 0.05]) for _ in range(9)])
            for _ in range(3)]
    runs.append(streamed(engine, cut(rng, TEXT), [0, 0, 0.8, 0, 0, 0, 0, 0, 0]))  # rows wait for text
    for audio, usage in await asyncio.gather(*runs):
        assert audio.shape == expected.shape
        np.testing.assert_allclose(audio, expected, atol=1e-5, rtol=0)
        assert usage.input_tokens == len(engine.prompts.tokenize(request(TEXT)).text_ids)

    with pytest.raises(RequestTimedOut, match="no text for 0.3 s"):  # its text stops coming
        async with await engine.open_text_stream(request(), idle_timeout=0.3) as stream:
            await stream.append("Hello there, ")
            async for _ in stream:
                pass
    with pytest.raises(RequestError, match="input is"):
        await streamed(engine, ["word " * 600], [0])           # over max_text_tokens (512)
    with pytest.raises(RequestError, match="input text is empty"):
        await streamed(engine, ["\n", "  "], [0, 0])
    with pytest.raises(RequestError, match="non_streaming_mode"):
        await engine.open_text_stream(SynthesisRequest(text="", voice="vivian", non_streaming_mode=True))
    stream = await engine.open_text_stream(request())
    await stream.append(RUNS_OUT_OF_TEXT)
    await eventually_async(lambda: parked(engine), what="its row waiting for more text")  # abandoned in flight
    await stream.aclose()
    await wait_until_no_stage_holds_requests(engine)
    assert engine.requests == {}


@pytest.mark.asyncio(loop_scope="module")
async def test_frames_made_before_the_text_runs_out_are_sent_at_once(engine):
    """A request that has caught up with its text sends the frames it holds instead of keeping them for a full chunk:
    while no more text comes, the audio for the words already there must reach the player."""
    first, rest = "One two three four five six seven eight nine ten", " eleven twelve."
    expected = await whole(engine, first + rest)
    received: list[np.ndarray] = []
    async with await engine.open_text_stream(request()) as stream:
        async def consume():
            async for chunk in stream:
                received.append(chunk.audio)
        consumer = asyncio.create_task(consume())
        # a frame per token of `first`, but the last (held back: the next piece might continue its word),
        # the prefill's and one to spare; the chunk size (25) is above it, so only an early send gets them
        # out while the talker waits for more text
        frames_for_first = len(engine.prompts.tokenize(request(first)).text_ids) - 3
        await stream.append(first)

        async def first_words_out():
            return sum(a.size for a in received) >= frames_for_first * SAMPLES_PER_FRAME
        await eventually_async(first_words_out, what="the audio of the text so far, before more text")
        await stream.append(rest)
        await stream.finish()
        await consumer
    audio = np.concatenate(received)
    assert audio.shape == expected.shape
    np.testing.assert_allclose(audio, expected, atol=1e-5, rtol=0)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_waits_show_in_the_stats_and_a_failed_stage_fails_the_stream(engine):
    stream = await engine.open_text_stream(request())
    await stream.append(RUNS_OUT_OF_TEXT)
    await eventually_async(lambda: parked(engine), what="a row parked until more text comes")
    os.kill(engine.stage_pids()["talker"], signal.SIGKILL)
    with pytest.raises(StageDeadError):
        async for _ in stream:
            pass
    await stream.append("and this goes nowhere")  # the request is gone: nothing to send it to
    await stream.aclose()
    await eventually_async(lambda: engine.is_healthy, RESTART_TIMEOUT, "the pipeline restarted")
    await wait_until_no_stage_holds_requests(engine)


def test_an_icl_prefill_waits_for_as_many_text_tokens_as_the_reference_has_frames():
    ref = dict(ref_audio=str(FIXTURES / "ref_voice.wav"), ref_text=(FIXTURES / "ref_voice.txt").read_text())
    text = TEXT + " " + TEXT

    async def main():
        async with AsyncTTS(str(FIXTURES / "tiny-base"), load_stage_config("cpu_tiny")) as engine:
            async def waiting_prompt():
                return (await engine.stats())["talker"].prompts_waiting_for_text == 1

            expected = await whole(engine, text, **ref)
            async with await engine.open_text_stream(request(**ref)) as stream:
                await stream.append(text[:40])  # ~10 tokens: the reference has 43 frames
                await eventually_async(waiting_prompt, what="a prompt waiting for text")
                await stream.append(text[40:])
                await stream.finish()
                audio = np.concatenate([c.audio async for c in stream])
            np.testing.assert_allclose(audio, expected, atol=1e-5, rtol=0)
    asyncio.run(main())
