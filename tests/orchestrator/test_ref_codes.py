"""A voice kept across requests: `generate(return_codes=True)` hands back the codes a request's audio was decoded
from, and a later request clones that voice by ICL from them (`SynthesisRequest.ref_codes` + `ref_text`), on
VoiceDesign (the instructions stay in the prompt) and Base (the x-vector still from a clip or a sent vector).
Real stage processes, checked against the in-process offline engine."""
import asyncio

import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.config import load_stage_config
from omni_tts.engine.offline import prepare, synthesize
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import PromptBuilder, PromptLimits, RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer
from omni_tts.orchestrator.async_tts import AsyncTTS

DESIGN = "A calm, low voice, unhurried."
FIRST = "The first sentence of the chapter."
SECOND = "And the second one follows it."


def greedy(**kwargs) -> SynthesisRequest:
    return SynthesisRequest(language="english", sampling=SamplingParams(temperature=0, max_new_tokens=24), **kwargs)


async def collect(engine, request, **kwargs):
    chunks = [c async for c in engine.generate(request, **kwargs)]
    return np.concatenate([c.audio for c in chunks]), chunks[-1]


def assert_audio_equal(audio: np.ndarray, expected: np.ndarray) -> None:
    assert audio.shape == expected.shape
    np.testing.assert_allclose(audio, expected, atol=1e-5, rtol=0)


def test_voice_design_returns_its_codes_and_a_later_request_clones_them():
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-voice-design"))
    first = greedy(text=FIRST, instructions=DESIGN)
    offline_first = synthesize(tts, [first])[0]
    clone = greedy(text=SECOND, instructions=DESIGN, ref_codes=offline_first.codes, ref_text=FIRST)
    offline_clone = synthesize(tts, [clone])[0]
    designed = synthesize(tts, [greedy(text=SECOND, instructions=DESIGN)])[0]
    assert not np.array_equal(offline_clone.codes, designed.codes)  # the reference is in the prompt
    # the streaming layout, as a text that arrives in pieces has it
    streamed_clone = greedy(text=SECOND, instructions=DESIGN, ref_codes=offline_first.codes, ref_text=FIRST,
                            non_streaming_mode=False)
    offline_streamed = synthesize(tts, [streamed_clone])[0]

    async def main():
        async with AsyncTTS(str(FIXTURES / "tiny-voice-design"), load_stage_config("cpu_tiny")) as engine:
            plain, last = await collect(engine, first)
            assert last.codes is None
            audio, last = await collect(engine, first, return_codes=True)
            np.testing.assert_array_equal(audio, plain)  # the flag changes nothing of the audio
            assert last.codes.shape == (last.usage.output_frames, 16)
            np.testing.assert_array_equal(last.codes, offline_first.codes)
            assert_audio_equal(audio, offline_first.audio)

            audio, last = await collect(engine, greedy(text=SECOND, instructions=DESIGN, ref_codes=last.codes,
                                                       ref_text=FIRST), return_codes=True)
            assert last.usage.reference_frames == offline_first.codes.shape[0]
            np.testing.assert_array_equal(last.codes, offline_clone.codes)
            assert_audio_equal(audio, offline_clone.audio)

            async with await engine.open_text_stream(streamed_clone) as stream:
                for word in SECOND.split(" "):
                    await stream.append(word + " ")
                await stream.finish()
                chunks = [c async for c in stream]
            assert chunks[-1].usage.reference_frames == offline_first.codes.shape[0]
            assert_audio_equal(np.concatenate([c.audio for c in chunks]), offline_streamed.audio)

            with pytest.raises(RequestError) as refused:
                await collect(engine, greedy(text=SECOND, instructions=DESIGN, ref_codes=offline_first.codes))
            assert refused.value.param == "ref_text"
            assert not engine.requests
    asyncio.run(main())


def test_base_takes_ref_codes_beside_the_clips_x_vector():
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-base"))
    clip = str(FIXTURES / "ref_voice.wav")
    ref_text = (FIXTURES / "ref_voice.txt").read_text().strip()
    first = synthesize(tts, [greedy(text=FIRST, ref_audio=clip, ref_text=ref_text)])[0]
    anchored = greedy(text=SECOND, ref_audio=clip, ref_codes=first.codes, ref_text=FIRST)
    offline_anchored = synthesize(tts, [anchored])[0]
    prompt = prepare(tts, anchored).prompt
    np.testing.assert_array_equal(prompt.ref_codes.numpy(), first.codes)
    clip_prompt = prepare(tts, greedy(text=SECOND, ref_audio=clip, ref_text=ref_text)).prompt
    np.testing.assert_array_equal(prompt.speaker_embedding.numpy(), clip_prompt.speaker_embedding.numpy())
    # a sent x-vector with the codes: the same prompt
    by_vector = greedy(text=SECOND, speaker_embedding=clip_prompt.speaker_embedding.numpy(),
                       ref_codes=first.codes, ref_text=FIRST)
    np.testing.assert_array_equal(synthesize(tts, [by_vector])[0].codes, offline_anchored.codes)
    plain_clone = synthesize(tts, [greedy(text=SECOND, ref_audio=clip, ref_text=ref_text)])[0]

    async def main():
        async with AsyncTTS(str(FIXTURES / "tiny-base"), load_stage_config("cpu_tiny")) as engine:
            # the clip's features are cached under the voice version without its codes (they were given) ...
            audio, last = await collect(engine, greedy(text=SECOND, ref_audio=clip, ref_codes=first.codes,
                                                       ref_text=FIRST), voice_version="v1")
            assert last.usage.reference_frames == first.codes.shape[0]
            assert_audio_equal(audio, offline_anchored.audio)
            # ... so an ICL request of that voice still gets the clip's own codes
            audio, last = await collect(engine, greedy(text=SECOND, ref_audio=clip, ref_text=ref_text),
                                        voice_version="v1")
            assert last.usage.reference_frames == clip_prompt.ref_codes.shape[0]
            assert_audio_equal(audio, plain_clone.audio)
    asyncio.run(main())


def builder(variant: str, max_model_len: int = 2048) -> PromptBuilder:
    model_dir = str(FIXTURES / variant)
    return PromptBuilder(Qwen3TTSConfig.load(model_dir), load_text_tokenizer(model_dir),
                         PromptLimits(max_text_tokens=256, max_model_len=max_model_len))


CODES = np.arange(3 * 16).reshape(3, 16)


@pytest.mark.parametrize("variant,fields,param,message", [
    ("tiny-voice-design", dict(ref_codes=CODES[:, :15]), "ref_codes", "frames of 16 codes each"),
    ("tiny-voice-design", dict(ref_codes=CODES[0]), "ref_codes", r"got shape \[16\]"),
    ("tiny-voice-design", dict(ref_codes=np.zeros((0, 16), np.int64)), "ref_codes", "at least one frame"),
    ("tiny-voice-design", dict(ref_codes=[[1] * 16, [1] * 15]), "ref_codes", "ragged"),
    ("tiny-voice-design", dict(ref_codes=CODES + 2001), "ref_codes", "must lie in 0..2047"),
    ("tiny-voice-design", dict(ref_codes=CODES - 1), "ref_codes", "must lie in 0..2047"),
    ("tiny-voice-design", dict(ref_codes=CODES.astype(np.float32)), "ref_codes", "must hold integers"),
    ("tiny-voice-design", dict(ref_codes=CODES), "ref_text", "ref_text is required with ref_codes"),
    ("tiny-voice-design", dict(ref_codes=CODES, ref_text="  "), "ref_text", "ref_text is required with ref_codes"),
    ("tiny-custom-voice", dict(ref_codes=CODES, ref_text="Hi.", voice="ryan"), "ref_codes",
     "only supported by VoiceDesign and Base"),
    ("tiny-base", dict(ref_codes=CODES, ref_text="Hi."), "ref_audio", "or a speaker_embedding"),
    ("tiny-base", dict(ref_codes=CODES, ref_text="Hi.", ref_audio=np.zeros(24000, np.float32),
                       x_vector_only=True), "ref_codes", "x_vector_only"),
])
def test_bad_ref_codes_are_refused_naming_the_field(variant, fields, param, message):
    with pytest.raises(RequestError, match=message) as refused:
        builder(variant).tokenize(SynthesisRequest(text="Hello.", **fields))
    assert refused.value.param == param


def test_ref_codes_count_toward_the_talkers_limits():
    prompts = builder("tiny-voice-design", max_model_len=100)
    codes = np.zeros((60, 16), np.int64)
    assert prompts.tokenize(SynthesisRequest(text="Hello.", ref_codes=codes, ref_text="Hi.")).ref_text_ids
    with pytest.raises(RequestError, match="90 reference frames") as refused:
        prompts.tokenize(SynthesisRequest(text="Hello.", ref_codes=np.zeros((90, 16), np.int64), ref_text="Hi."))
    assert refused.value.param == "ref_codes"
