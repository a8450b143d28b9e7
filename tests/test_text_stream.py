"""AsyncTTSEngine.open_text_stream with real stage processes: text appended in pieces, with pauses, gives the whole
text's audio; its failures (limits, idle, abort) end it in both stages."""
import asyncio
import random

import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.config import load_stage_config
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.async_engine import AsyncTTSEngine, RequestTimedOut

TEXT = "Hello there! This sentence streams in, a few characters at a time, with a pause or two."


def request(text: str = "", **kwargs) -> SynthesisRequest:
    return SynthesisRequest(text=text, voice="vivian", non_streaming_mode=False,
                            sampling=SamplingParams(temperature=0, max_new_tokens=60), **kwargs)


async def whole(engine: AsyncTTSEngine, text: str) -> np.ndarray:
    return np.concatenate([c.audio async for c in engine.generate(request(text))])


async def streamed(engine: AsyncTTSEngine, pieces: list[str], delays: list[float], **kwargs):
    async with await engine.open_text_stream(request(), **kwargs) as stream:
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


def cut(rng: random.Random, text: str) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), 8))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


async def stages_hold_nothing(engine: AsyncTTSEngine) -> None:
    for _ in range(50):
        stats = await engine.stats()
        if not any(s.request_ids for s in stats.values()):
            return
        await asyncio.sleep(0.1)
    raise AssertionError({name: s.request_ids for name, s in stats.items()})


def test_pieces_with_pauses_give_the_whole_texts_audio_and_failures_free_the_stages():
    async def main():
        async with AsyncTTSEngine(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny")) as engine:
            expected = await whole(engine, TEXT)
            rng = random.Random(3)
            runs = [streamed(engine, cut(rng, TEXT), [rng.choice([0, 0.01, 0.05]) for _ in range(9)])
                    for _ in range(3)]
            runs.append(streamed(engine, cut(rng, TEXT), [0, 0, 0.8, 0, 0, 0, 0, 0, 0]))  # rows wait for text
            for audio, usage in await asyncio.gather(*runs):
                assert audio.shape == expected.shape
                np.testing.assert_allclose(audio, expected, atol=1e-5, rtol=0)
                assert usage.input_tokens == len(engine.prompts.tokenize(request(TEXT)).text_ids)

            with pytest.raises(RequestTimedOut, match="no text for 0.3 s"):
                await streamed(engine, ["Hello there, ", "and then"], [0, 1.0], idle_timeout=0.3)
            with pytest.raises(RequestError, match="input is"):
                await streamed(engine, ["word " * 600], [0])           # over max_text_tokens (512)
            with pytest.raises(RequestError, match="input text is empty"):
                await streamed(engine, ["\n", "  "], [0, 0])
            with pytest.raises(RequestError, match="non_streaming_mode"):
                await engine.open_text_stream(SynthesisRequest(text="", voice="vivian", non_streaming_mode=True))
            stream = await engine.open_text_stream(request())
            await stream.append("Abandoned before its end, this one")
            await asyncio.sleep(0.5)
            await stream.aclose()
            await stages_hold_nothing(engine)
            assert engine.requests == {}
    asyncio.run(main())
