"""A narration through stage failures (real stage processes, tiny fixture, greedy): a segment that fails is made again
once the pipeline serves again — afresh when none of its audio was taken, from where the listener is when some was —
and the narration's audio is the one an unfailed run makes; a second failure of one segment ends the narration."""
import asyncio
import os
import signal

import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.config import load_stage_config
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.narration import Narration, Pauses, wait_until_serving
from omni_tts.orchestrator.segmenter import segment_text
from omni_tts.orchestrator.types import SegmentEnd, SegmentStart, StageDeadError
from waiting import RESTART_TIMEOUT, eventually_async

# segment 0 ("Hi.", 2 text tokens) has a budget of 192 frames; each later one (~60 text tokens) 12 per token: while
# the reader takes segment 0 whole, segment 1 is still being made, whatever the machine's speed (same steps)
LONG = "the lighthouse keeper counted every ship that passed the rocks below his window"
TEXT = "Hi. " + " ".join(f"{LONG.capitalize()} on night number {i}, and wrote each name down." for i in range(3))
TEMPLATE = SynthesisRequest(text="", voice="ryan", non_streaming_mode=True,
                            sampling=SamplingParams(temperature=0, max_new_tokens=2000, seed=3))


def same_audio(chunks: list, expected: list) -> None:
    """The same codes decoded: equal within float rounding (the decoder's batches differ between the runs)."""
    np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]),
                               np.concatenate([c.audio for c in expected]), rtol=0, atol=1e-5)


def test_a_failed_segment_is_made_again_before_and_during_its_delivery():
    asyncio.run(_faults())


@pytest.mark.slow   # opt-in (--runslow): two more pipeline restarts
def test_a_segment_that_fails_twice_ends_the_narration():
    asyncio.run(_fails_twice())


async def _fails_twice() -> None:
    segments = segment_text(TEXT, max_chars=200)
    async with AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny")) as engine:
        chunks = Narration(engine.generate, TEMPLATE, segments, "cut", window=2,
                           ready=lambda: wait_until_serving(engine)).chunks()
        await anext(chunks)
        os.kill(engine.stage_pids()["talker"], signal.SIGKILL)
        await eventually_async(lambda: "cut-s0-r1" in engine.requests, RESTART_TIMEOUT,
                               "the retry, in the new pipeline")
        os.kill(engine.stage_pids()["talker"], signal.SIGKILL)
        with pytest.raises(StageDeadError):
            async for _ in chunks:
                pass
        await wait_until_serving(engine)
        assert not engine.requests and sum(engine.restarts.values()) == 2


async def _faults() -> None:
    segments = segment_text(TEXT, max_chars=200)
    assert segments[0].text == "Hi." and len(segments) == 4
    async with AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny")) as engine:
        def narration(name: str) -> Narration:
            return Narration(engine.generate, TEMPLATE, segments, name, window=2, pauses=Pauses(0.1, 0.2),
                             ready=lambda: wait_until_serving(engine))

        clean = [c async for c in narration("clean").chunks()]

        # 1. segment 0 taken whole while segment 1 runs: the talker dies; segment 1 is made again
        chunks, taken = narration("retried").chunks(), []
        while not isinstance((chunk := await anext(chunks)).segment, SegmentEnd):
            taken.append(chunk)
        taken.append(chunk)
        assert "retried-s1" in engine.requests   # in the stages, none of its audio taken
        os.kill(engine.stage_pids()["talker"], signal.SIGKILL)
        taken += [c async for c in chunks]
        attempts = [c.segment.attempts for c in taken if isinstance(c.segment, SegmentEnd)]
        assert attempts[:2] == [1, 2] and max(attempts) == 2, attempts   # a later one may meet the restart too
        same_audio(taken, clean)

        # 2. the talker dies while segment 0 is being delivered: it goes on from where the listener is
        chunks = narration("resumed").chunks()
        taken = [await anext(chunks)]
        assert isinstance(taken[0].segment, SegmentStart) and "resumed-s0" in engine.requests
        os.kill(engine.stage_pids()["talker"], signal.SIGKILL)
        taken += [c async for c in chunks]
        assert [c.segment.attempts for c in taken if isinstance(c.segment, SegmentEnd)][0] == 2
        same_audio(taken, clean)
