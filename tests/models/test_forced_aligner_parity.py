"""The plain-PyTorch forced aligner against the official reference's goldens (tests/fixtures/qwen3_forced_aligner)."""
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.numpy import load_file

from omni_tts.models.qwen3_forced_aligner.aligner import AlignItem, ForcedAligner
from omni_tts.models.qwen3_forced_aligner.encoder import encoder_length
from omni_tts.models.qwen3_forced_aligner.features import log_mel, num_frames, to_16k

HERE = Path(__file__).resolve().parents[1] / "fixtures"
ALIGNER_FIXTURES = HERE / "qwen3_forced_aligner"
CHECKPOINT = ALIGNER_FIXTURES / "tiny-forced-aligner"
MANIFEST = json.loads((ALIGNER_FIXTURES / "manifest.json").read_text(encoding="utf-8"))
CASES = MANIFEST["cases"]
ARRAYS = load_file(str(ALIGNER_FIXTURES / "cases.safetensors"))


def case_audio(case: dict) -> np.ndarray:
    if "audio_file" in case:
        wav, sr = sf.read(str(HERE / "qwen3_tts" / case["audio_file"]), dtype="float32")
        assert sr == case["sample_rate"]
        return np.concatenate([wav] * case["repeat"])
    pcm = ARRAYS[f"{case['name']}.pcm16"]
    return pcm.astype(np.float32) / 32768 * np.float32(case["gain"])


@pytest.fixture(scope="module")
def aligner() -> ForcedAligner:
    return ForcedAligner(str(CHECKPOINT))


def model_inputs(aligner: ForcedAligner, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    audio = to_16k(case_audio(case), case["sample_rate"])
    words = [w for w, _, _ in case["words"]]
    tokens = encoder_length(num_frames(audio.shape[0]), aligner.model.audio_tower.chunk_frames)
    return torch.tensor(aligner.prompt_ids(words, tokens)), log_mel(audio, aligner.cfg.audio.num_mel_bins)


# What two fp32 runs (pocketfft or MKL's FFT, AVX2 or AVX-512 matmuls: other reduction orders) can differ by.
# Features are log10(mel power)/4, kept down to 8 decades below the loudest band. A 400-point fp32 STFT errs by
# ~u*sqrt(log2 400) ~ 1.8e-7 of its frame's amplitude in every bin, so a band 1e4 below its frame in amplitude has
# a relative power error of ~2 * 1.8e-7 * 1e4 = 3.5e-3: 3.5e-3 / (4 ln 10) ~ 4e-4 in the feature (loud bands: ~1e-7).
# These clips' fp32 features are within 5e-5 of an fp64 run; a 2-core Xeon was 4e-5 from the goldens.
FEATURES_ATOL = 4e-4
# Encoder outputs (|x| < 1.6) after 3 convs and 2 layers with reductions <= 128 wide: ~u*sqrt(128)*10 ops ~ 7e-6
# relative each run, plus its input features' spread; the whole chain is within 5e-6 of an fp64 run here.
ENCODER_ATOL = 1e-4


@pytest.mark.parametrize("case", [c for c in CASES if c["words"]], ids=lambda c: c["name"])
def test_prompt_encoder_and_classes_equal_the_reference(aligner, case):
    ids, features = model_inputs(aligner, case)
    assert ids.tolist() == ARRAYS[f"{case['name']}.input_ids"].tolist()
    if f"{case['name']}.features" in ARRAYS:
        np.testing.assert_allclose(features.numpy(), ARRAYS[f"{case['name']}.features"], rtol=0, atol=FEATURES_ATOL)
    encoded = aligner.model.audio_tower(features)
    np.testing.assert_allclose(encoded.detach().numpy(), ARRAYS[f"{case['name']}.encoder_output"], rtol=0,
                               atol=ENCODER_ATOL)
    # exact: the smallest top-1 margin of these logits (7e-4) is ~70x their spread against an fp64 run (1e-5)
    classes = aligner.model.classify([ids], [features])[0]
    assert classes.tolist() == ARRAYS[f"{case['name']}.classes"].tolist()


def test_a_long_clip_is_attended_in_windows():
    """Past one window (8 s) the encoder's windows change its output: the golden is the windowed one."""
    assert [c["name"] for c in CASES if c["windows_matter"]] == ["en_long_20s_24k"]


def test_batched_classes_equal_one_at_a_time(aligner):
    cases = [c for c in CASES if c["words"]]
    inputs = [model_inputs(aligner, c) for c in cases]
    batched = aligner.model.classify([i for i, _ in inputs], [f for _, f in inputs])
    for case, classes in zip(cases, batched):
        assert classes.tolist() == ARRAYS[f"{case['name']}.classes"].tolist(), case["name"]


def test_make_tiny_model_writes_the_fixture_checkpoint(tmp_path, capsys):
    from omni_tts.entrypoints.cli import main

    out = tmp_path / "aligner"
    assert main(["make-tiny-model", str(out), "--variant", "forced_aligner", "--seed", "20260122"]) == 0
    for name in ("config.json", "preprocessor_config.json", "tokenizer_config.json", "model.safetensors",
                 "vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (CHECKPOINT / name).read_bytes(), name
    assert main(["make-tiny-model", str(tmp_path / "big"), "--variant", "forced_aligner", "--preset", "small"]) == 2
    assert "preset must be one of tiny, 0.6b" in capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_word_times_equal_the_reference(aligner, case):
    """The whole pipeline: words (`words.split_words`), prompt, classes, fix-up; times in seconds as the reference."""
    if case["language"] == "Japanese":
        pytest.importorskip("nagisa")
    [words] = aligner.align([AlignItem(case_audio(case), case["sample_rate"], case["text"], case["language"])])
    assert [[w.word, round(w.start_ms / 1000, 3), round(w.end_ms / 1000, 3)] for w in words] == case["words"]
