"""End to end: `Qwen3TTS.synthesize` (and the CLI) against every public golden case."""
import numpy as np
import pytest
import soundfile as sf

from conftest import FIXTURES, GOLDEN_CASES, case_arrays, case_requests
from omni_tts.engine.offline import prepare, synthesize
from omni_tts.entrypoints.cli import main as cli_main
from omni_tts.models.qwen3_tts.model import Qwen3TTS

_models: dict[str, Qwen3TTS] = {}


def model_for(variant: str) -> Qwen3TTS:
    if variant not in _models:
        _models[variant] = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    return _models[variant]


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda c: c["name"])
def test_synthesize_matches_reference(case):
    arrays = case_arrays(case)
    tts = model_for(case["variant"])
    requests = case_requests(case)
    results = synthesize(tts, requests)
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.codes, arrays[f"codes_{i}"])
        assert result.audio.dtype == np.float32 and result.audio.shape == arrays[f"wav_{i}"].shape
        np.testing.assert_allclose(result.audio, arrays[f"wav_{i}"], atol=1e-4, rtol=0)
        if f"speaker_embedding_{i}" in arrays:
            prompt = prepare(tts, requests[i]).prompt
            np.testing.assert_allclose(prompt.speaker_embedding.numpy(), arrays[f"speaker_embedding_{i}"], atol=1e-4)
            if f"ref_codes_{i}" in arrays:
                np.testing.assert_array_equal(prompt.ref_codes.numpy(), arrays[f"ref_codes_{i}"])
    if len(requests) > 1:  # the batch equals each request alone
        for i, request in enumerate(requests):
            alone = synthesize(tts, [request])[0]
            np.testing.assert_array_equal(alone.codes, results[i].codes)
            np.testing.assert_array_equal(alone.audio, results[i].audio)


def test_cli_synthesize_wav_npy_and_codes(tmp_path):
    case = next(c for c in GOLDEN_CASES if c["name"] == "cv_en_instruct_nonstreaming")
    arrays = case_arrays(case)
    p = case["params"]
    args = ["synthesize", "--model", str(FIXTURES / case["variant"]), "--text", p["text"], "--voice", p["speaker"],
            "--language", p["language"], "--instructions", p["instruct"], "--non-streaming-mode", "--temperature", "0",
            "--max-new-tokens", str(p["max_new_tokens"])]
    assert cli_main(args + ["--out", str(tmp_path / "a.npy"), "--codes-out", str(tmp_path / "c.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "a.npy"), arrays["wav_0"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), arrays["codes_0"])
    assert cli_main(args + ["--out", str(tmp_path / "a.wav")]) == 0
    pcm, sr = sf.read(tmp_path / "a.wav", dtype="int16")
    info = sf.info(tmp_path / "a.wav")
    assert sr == 24000 and info.subtype == "PCM_16" and pcm.shape == arrays["wav_0"].shape
    expected = np.clip(arrays["wav_0"], -1, 1) * 32767
    assert np.abs(pcm.astype(np.float64) - expected).max() <= 1.5


def test_cli_voice_clone_from_ref_audio(tmp_path):
    case = next(c for c in GOLDEN_CASES if c["name"] == "base_icl_streaming_layout")
    arrays = case_arrays(case)
    p = case["params"]
    assert cli_main(["synthesize", "--model", str(FIXTURES / "tiny-base"), "--task-type", "Base", "--text", p["text"],
                     "--language", p["language"], "--ref-audio", str(FIXTURES / p["ref_audio"]), "--ref-text",
                     p["ref_text"], "--streaming-mode", "--temperature", "0", "--max-new-tokens",
                     str(p["max_new_tokens"]), "--out", str(tmp_path / "clone.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "clone.npy"), arrays["wav_0"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("args,message", [
    (["--voice", "nobody"], "unknown voice 'nobody'"),
    (["--language", "klingon"], "unsupported language 'klingon'"),
    (["--task-type", "Base"], "does not match the loaded CustomVoice checkpoint"),
    (["--temperature", "-1"], "temperature must be a number in [0, 100]"),
    (["--top-p", "1.5"], "top_p must be a number in (0, 1]"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer in [2, 8192]"),
    (["--ref-audio", "/nonexistent.wav"], "file not found"),
    (["--text", "   "], "input text is empty"),
])
def test_cli_bad_arguments_exit_nonzero(tmp_path, capsys, args, message):
    base = ["synthesize", "--model", str(FIXTURES / "tiny-custom-voice"), "--text", "Hello.", "--voice", "ryan"]
    assert cli_main(base + args + ["--out", str(tmp_path / "x.wav")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


def test_cli_rejects_bad_output_and_missing_model(tmp_path, capsys):
    assert cli_main(["synthesize", "--model", str(FIXTURES / "tiny-custom-voice"), "--text", "Hi.",
                     "--out", str(tmp_path / "x.mp3")]) == 2
    assert "--out must end in .wav or .npy" in capsys.readouterr().err
    assert cli_main(["synthesize", "--model", str(tmp_path / "nothing-here"), "--text", "Hi.",
                     "--out", str(tmp_path / "x.wav")]) == 2
    assert "neither a local checkpoint directory nor a Hugging Face repo id" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["synthesize", "--text", "Hi."])  # --out missing: argparse usage error
    assert exc.value.code == 2


def test_voice_clone_requires_ref_audio_and_text():
    from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest

    tts = model_for("tiny-base")
    with pytest.raises(RequestError, match="ref_audio is required"):
        prepare(tts, SynthesisRequest(text="Hi."))
    with pytest.raises(RequestError, match="ref_text is required"):
        prepare(tts, SynthesisRequest(text="Hi.", ref_audio=str(FIXTURES / "ref_voice.wav")))
    with pytest.raises(RequestError, match="could not read ref_audio"):
        prepare(tts, SynthesisRequest(text="Hi.", ref_audio=b"not audio at all", x_vector_only=True))
