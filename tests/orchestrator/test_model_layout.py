"""Several models behind one engine (issue 36): the tiny CustomVoice, VoiceDesign and Base checkpoints with one talker
each and one code2wav for all three (their decoders are the same), each request routed by its model. Every golden
case through it gives the reference's codes and the single-model audio, all cases at once included; models whose
decoders differ get a code2wav each. (Through the server, idle unloading too: tests/entrypoints/test_several_models.py.)"""
import asyncio

import numpy as np
import pytest
import pytest_asyncio

from conftest import FIXTURES, GOLDEN_CASES, case_arrays, case_requests
from omni_tts.config import load_stage_config
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_model
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.model_layout import ServedCheckpoint
from waiting import SHARED_PIPELINE

VARIANTS = ("tiny-custom-voice", "tiny-voice-design", "tiny-base")
MODELS = [ServedCheckpoint(variant, str(FIXTURES / variant)) for variant in VARIANTS]
CASES = [case for case in GOLDEN_CASES if case["variant"] in VARIANTS]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    async with AsyncTTS(MODELS, load_stage_config("cpu_tiny"), **SHARED_PIPELINE) as engine:
        yield engine


async def codes_and_audio(engine, request, model):
    chunks = [c async for c in engine.generate(request, model=model, return_codes=True)]
    return chunks[-1].codes, np.concatenate([c.audio for c in chunks])


def test_one_code2wav_serves_the_three_talkers(engine):
    pids = engine.stage_pids()
    assert set(pids) == {"talker", "talker:tiny-voice-design", "talker:tiny-base", "code2wav"}
    assert len(set(pids.values())) == 4
    assert engine.layout.decoders == {"code2wav": str(FIXTURES / "tiny-custom-voice")}


@pytest.mark.asyncio(loop_scope="module")
async def test_every_golden_case_is_exact_per_model_all_at_once(engine):
    requests = [(case, i, request) for case in CASES for i, request in enumerate(case_requests(case))]
    results = await asyncio.gather(*(codes_and_audio(engine, request, case["variant"])
                                     for case, _, request in requests))
    models = {variant: Qwen3TTS.from_pretrained(str(FIXTURES / variant)) for variant in VARIANTS}
    for (case, i, request), (codes, audio) in zip(requests, results):
        np.testing.assert_array_equal(codes, case_arrays(case)[f"codes_{i}"], err_msg=case["name"])
        alone = synthesize(models[case["variant"]], [request])[0]   # the single-model audio
        np.testing.assert_allclose(audio, alone.audio, atol=1e-5, rtol=0, err_msg=case["name"])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_for_a_model_not_served_is_refused(engine):
    with pytest.raises(RequestError, match="model 'nope' is not served here; served: tiny-custom-voice, "
                                           "tiny-voice-design, tiny-base") as caught:
        await anext(engine.generate(SynthesisRequest(text="Hi."), model="nope"))
    assert caught.value.param == "model"


def test_models_whose_decoders_differ_get_a_code2wav_each(tmp_path):
    """A checkpoint with a decoder of its own (other random weights) is decoded by a code2wav of its own: each model's
    audio equals its offline synthesis."""
    other = make_random_model(str(tmp_path / "other"), seed=7)
    models = [MODELS[0], ServedCheckpoint("other", other)]
    request = SynthesisRequest(text="Two decoders.", voice="ryan",
                               sampling=SamplingParams(temperature=0, max_new_tokens=30))

    async def main():
        async with AsyncTTS(models, load_stage_config("cpu_tiny")) as engine:
            assert engine.layout.decoders == {"code2wav": MODELS[0].model_dir, "code2wav:other": other}
            assert set(engine.stage_pids()) == {"talker", "talker:other", "code2wav", "code2wav:other"}
            return await asyncio.gather(*(codes_and_audio(engine, request, model.name) for model in models))
    results = asyncio.run(main())
    for model, (codes, audio) in zip(models, results):
        expected = synthesize(Qwen3TTS.from_pretrained(model.model_dir), [request])[0]
        np.testing.assert_array_equal(codes, expected.codes)
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)
