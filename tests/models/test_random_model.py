"""`omni-tts make-tiny-model`: deterministic random checkpoints in the HF layout that load and synthesize."""
import filecmp
import os

import numpy as np
import pytest

from omni_tts.engine.offline import synthesize
from omni_tts.entrypoints.cli import main as cli_main
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import default_model_dir
from omni_tts.models.qwen3_tts.sampling import SamplingParams

from conftest import FIXTURES

FILES = ["config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json",
         "model.safetensors", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
         "speech_tokenizer/preprocessor_config.json"]


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design", "base"])
def test_tiny_checkpoint_layout_loads_and_synthesizes(tmp_path, variant):
    out = tmp_path / variant
    assert cli_main(["make-tiny-model", str(out), "--variant", variant, "--seed", "7"]) == 0
    for name in FILES:
        assert (out / name).is_file(), name
    # the text tokenizer files equal the real Qwen2 ones the fixtures carry
    assert filecmp.cmp(out / "vocab.json", FIXTURES / "tiny-base" / "vocab.json", shallow=False)
    assert filecmp.cmp(out / "merges.txt", FIXTURES / "tiny-base" / "merges.txt", shallow=False)
    tts = Qwen3TTS.from_pretrained(str(out))
    assert tts.model_type == variant
    request = SynthesisRequest(text="Hello from a random model.", sampling=SamplingParams(seed=1, max_new_tokens=30))
    if variant == "custom_voice":
        request.voice = "vivian"
    if variant == "voice_design":
        request.instructions = "A bright voice."
    if variant == "base":
        request.ref_audio, request.ref_text = str(FIXTURES / "ref_voice.wav"), "The quick brown fox."
    result = synthesize(tts, [request])[0]
    assert result.codes.shape[1] == 16 and 1 <= result.codes.shape[0] <= 29
    assert result.audio.shape == (result.codes.shape[0] * 1920,)
    assert 1e-3 < np.abs(result.audio).mean() < 1.0  # audible, not clamped silence


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert cli_main(["make-tiny-model", str(tmp_path / name), "--variant", "base", "--seed", str(seed)]) == 0
    for name in FILES:
        assert filecmp.cmp(tmp_path / "a" / name, tmp_path / "b" / name, shallow=False), name
    assert not filecmp.cmp(tmp_path / "a" / "model.safetensors", tmp_path / "c" / "model.safetensors", shallow=False)


@pytest.mark.parametrize("preset,hidden,decoder_dim", [("small", 256, 256), ("medium", 384, 448)])
def test_cpu_benchmark_presets_and_dtype(tmp_path, preset, hidden, decoder_dim):
    out = tmp_path / preset
    assert cli_main(["make-tiny-model", str(out), "--variant", "custom_voice", "--preset", preset,
                     "--dtype", "float32"]) == 0
    tts = Qwen3TTS.from_pretrained(str(out))
    assert tts.config.talker.hidden_size == hidden and tts.config.talker.num_hidden_layers == 4
    assert tts.speech_config.decoder.sliding_window == 72
    assert tts.speech_config.decoder.decoder_dim == decoder_dim
    result = synthesize(tts, [SynthesisRequest(text="Small.", voice="ryan",
                                               sampling=SamplingParams(temperature=0, max_new_tokens=8))])[0]
    assert result.codes.shape == (7, 16) and result.finish_reason == "length"


def test_make_tiny_model_errors(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert cli_main(["make-tiny-model", str(tmp_path / "full"), "--variant", "base"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(SystemExit):
        cli_main(["make-tiny-model", str(tmp_path / "y"), "--variant", "base", "--preset", "huge"])
    assert not any(p.name.startswith(".tmp-omni-tts-") for p in tmp_path.iterdir())


def test_default_model_is_generated_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_TTS_CACHE", str(tmp_path))
    path = default_model_dir()
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert default_model_dir() == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp
    assert Qwen3TTS.from_pretrained(path).model_type == "custom_voice"
