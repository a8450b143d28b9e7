"""Base (voice clone) front end: audio reading/resampling, speaker encoder, Mimi speech encoder.

Goldens: tests/fixtures/qwen3_tts (see its README): `speaker_embedding_i` within 1e-4, `ref_codes_i` identical.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
from safetensors.numpy import load_file as load_np
from safetensors.torch import load_file as load_pt

from omni_tts.models.qwen3_tts.audio import load_audio, load_audio_24k, resample_to, resampled_length
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig, SpeakerEncoderConfig, SpeechTokenizerConfig
from omni_tts.models.qwen3_tts.mimi_config import MimiEncoderConfig
from omni_tts.models.qwen3_tts.speaker_encoder import (SpeakerEncoder, extract_speaker_embedding, mel_spectrogram,
                                                       slaney_mel_filterbank)
from omni_tts.models.qwen3_tts.speech_encoder import SpeechEncoder
from omni_tts.models.qwen3_tts.weights import WeightsError, load_strict

from conftest import load_component

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tts"
TINY_BASE = FIXTURES / "tiny-base"


def _base_rows() -> list[tuple[str, int, str, bool]]:
    """(case name, row index, ref_audio file, x_vector_only_mode) for every Base case row in the manifest."""
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    rows = []
    for case in manifest["cases"]:
        if case["call"] != "generate_voice_clone":
            continue
        params = case["params"]
        refs = params["ref_audio"] if isinstance(params["ref_audio"], list) else [params["ref_audio"]]
        xvec = params["x_vector_only_mode"]
        xvec = xvec if isinstance(xvec, list) else [xvec] * len(refs)
        rows += [(case["name"], i, ref, bool(x)) for i, (ref, x) in enumerate(zip(refs, xvec))]
    return rows


BASE_ROWS = _base_rows()
ICL_ROWS = [r for r in BASE_ROWS if not r[3]]


def _case_arrays(name: str) -> dict[str, np.ndarray]:
    return load_np(str(FIXTURES / "cases" / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def speaker_encoder() -> SpeakerEncoder:
    cfg = Qwen3TTSConfig.load(str(TINY_BASE)).speaker_encoder
    return load_component(lambda: SpeakerEncoder(cfg), TINY_BASE, "speaker_encoder.")


@pytest.fixture(scope="module")
def speech_encoder() -> SpeechEncoder:
    st = SpeechTokenizerConfig.load(str(TINY_BASE))
    return load_component(lambda: SpeechEncoder(MimiEncoderConfig.from_dict(st.encoder), st.encoder_valid_num_quantizers),
                          TINY_BASE / "speech_tokenizer", "encoder.")


@pytest.fixture(scope="module")
def ref_wav_24k() -> dict[str, np.ndarray]:
    return {name: load_audio_24k(FIXTURES / name) for name in sorted({r[2] for r in BASE_ROWS})}


# ------------------------------------------------------------------------------------------------ goldens

def test_manifest_has_base_rows():
    assert len(BASE_ROWS) >= 6 and ICL_ROWS
    assert {r[2] for r in BASE_ROWS} >= {"ref_voice.wav", "ref_voice_22k.wav"}


@pytest.fixture(scope="module")
def embeddings(speaker_encoder, ref_wav_24k) -> dict[str, np.ndarray]:
    return {name: extract_speaker_embedding(speaker_encoder, wav).numpy() for name, wav in ref_wav_24k.items()}


@pytest.mark.parametrize("case,row,ref,xvec_only", BASE_ROWS, ids=[f"{r[0]}-{r[1]}" for r in BASE_ROWS])
def test_speaker_embedding_matches_golden(embeddings, case, row, ref, xvec_only):
    golden = _case_arrays(case)[f"speaker_embedding_{row}"]
    got = embeddings[ref]
    assert got.shape == golden.shape == (64,) and got.dtype == np.float32
    assert np.abs(got - golden).max() <= 1e-4


@pytest.fixture(scope="module")
def ref_codes(speech_encoder, ref_wav_24k) -> dict[str, np.ndarray]:
    return {name: speech_encoder.encode(wav).numpy() for name, wav in ref_wav_24k.items()}


@pytest.mark.parametrize("case,row,ref,xvec_only", ICL_ROWS, ids=[f"{r[0]}-{r[1]}" for r in ICL_ROWS])
def test_ref_codes_match_golden(ref_codes, ref_wav_24k, case, row, ref, xvec_only):
    golden = _case_arrays(case)[f"ref_codes_{row}"]
    got = ref_codes[ref]
    assert got.dtype == np.int64 and got.shape == golden.shape
    assert got.shape == (math.ceil(len(ref_wav_24k[ref]) / 1920), 16)
    np.testing.assert_array_equal(got, golden)


def test_xvector_rows_have_no_ref_codes():
    for case, row, _, xvec_only in BASE_ROWS:
        if xvec_only:
            assert f"ref_codes_{row}" not in _case_arrays(case)


# ------------------------------------------------------------------------------------------------ audio

@pytest.mark.parametrize("sr", [22050, 44100, 16000, 48000])
def test_resample_length_rule(sr):
    rng = np.random.default_rng(sr)
    for n in (1, 2, 3, 146, 147, 1000, 1023, 4410, 12345, sr, 75818):
        y = (rng.standard_normal(n) * 0.1).astype(np.float32)
        out = resample_to(y, sr, 24000)
        assert out.dtype == np.float32 and out.ndim == 1
        assert len(out) == resampled_length(n, sr) == int(np.ceil(n * (24000.0 / sr)))
        # the exact quotient differs only where the float product rounds up past an exact integer
        exact = -(-n * 24000 // sr)
        assert len(out) in (exact, exact + 1)
        assert len(out) == exact or (n * 24000) % sr == 0


def test_resample_fixes_soxr_length_like_librosa():
    # 1 s at 22.05 kHz: librosa (the reference) returns 24001 samples (float ceil), soxr alone 24000
    y = np.random.default_rng(0).standard_normal(22050).astype(np.float32) * 0.1
    out = resample_to(y, 22050)
    assert len(out) == 24001 and out[-1] == 0.0
    np.testing.assert_array_equal(out[:24000], soxr.resample(y, 22050, 24000, quality=soxr.HQ)[:24000])
    # and a length where bare soxr is one sample short: zero-padded at the end
    n = next(n for n in range(1000, 1100) if len(soxr.resample(y[:n], 44100, 24000, quality="HQ"))
             < resampled_length(n, 44100))
    out = resample_to(y[:n], 44100)
    assert len(out) == resampled_length(n, 44100) and out[-1] == 0.0


def test_resample_same_rate_and_errors():
    y = np.linspace(-0.5, 0.5, 100, dtype=np.float32)
    assert resample_to(y, 24000) is y
    with pytest.raises(ValueError):
        resample_to(np.zeros(0, np.float32), 22050)
    with pytest.raises(ValueError):
        resample_to(np.zeros((2, 10), np.float32), 22050)


def test_load_audio_int16_stereo_and_bytes(tmp_path):
    pcm = np.array([[0, 100], [-32768, 32767], [1234, -1234], [7, 9]], dtype=np.int16)
    path = tmp_path / "stereo.wav"
    sf.write(str(path), pcm, 22050, subtype="PCM_16")
    wav, sr = load_audio(path)
    assert sr == 22050 and wav.dtype == np.float32 and wav.shape == (4,)
    expected = (pcm.astype(np.float32) / 32768).mean(axis=1, dtype=np.float32)
    np.testing.assert_array_equal(wav, expected)
    wav_b, sr_b = load_audio(path.read_bytes())
    assert sr_b == 22050
    np.testing.assert_array_equal(wav_b, wav)
    # FLAC from memory, mono
    buf = io.BytesIO()
    sf.write(buf, pcm[:, 0], 16000, format="FLAC", subtype="PCM_16")
    wav_f, sr_f = load_audio(buf.getvalue())
    assert sr_f == 16000
    np.testing.assert_array_equal(wav_f, pcm[:, 0].astype(np.float32) / 32768)


def test_load_audio_fixture_matches_24k_file():
    wav, sr = load_audio(FIXTURES / "ref_voice.wav")
    assert sr == 24000 and wav.dtype == np.float32
    np.testing.assert_array_equal(load_audio_24k(FIXTURES / "ref_voice.wav"), wav)


def test_load_audio_reads_in_blocks_and_stops_at_max_samples():
    # stereo, several read blocks long: the block-wise mix-down equals one whole-array mean
    rng = np.random.default_rng(7)
    stereo = (rng.standard_normal((150_000, 2)) * 0.1).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, stereo, 48000, format="WAV", subtype="FLOAT")
    whole, _ = sf.read(io.BytesIO(buf.getvalue()), dtype="float32", always_2d=True)
    wav, sr = load_audio(buf.getvalue())
    assert sr == 48000
    np.testing.assert_array_equal(wav, whole.mean(axis=1, dtype=np.float32))
    capped, _ = load_audio(buf.getvalue(), max_samples=70_000)
    np.testing.assert_array_equal(capped, wav[:70_000])


def test_load_audio_errors(tmp_path):
    with pytest.raises(ValueError):
        load_audio(b"")
    with pytest.raises(ValueError):
        load_audio(b"this is not audio at all" * 10)
    empty = tmp_path / "empty.wav"
    sf.write(str(empty), np.zeros(0, np.int16), 24000, subtype="PCM_16")
    with pytest.raises(ValueError):
        load_audio(empty)
    with pytest.raises(FileNotFoundError):
        load_audio(tmp_path / "missing.wav")


# ------------------------------------------------------------------------------------------------ mel

def test_mel_filterbank_sanity():
    w = slaney_mel_filterbank()
    assert w.shape == (128, 513) and w.dtype == np.float32
    assert (w >= 0).all() and (w.max(axis=1) > 0).all()  # no empty filter
    # values of librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    assert math.isclose(float(w.sum(dtype=np.float64)), 5.459415810865721, rel_tol=1e-6)
    np.testing.assert_allclose(w[0, :4], [0.0, 0.03355042636394501, 0.00856908317655325, 0.0], rtol=1e-6)
    assert int(w[64].argmax()) == 89 and math.isclose(float(w[64].max()), 0.01410350389778614, rel_tol=1e-6)
    assert int(w[127].argmax()) == 498 and int(np.nonzero(w[127])[0].max()) == 511  # nothing above 12 kHz
    # triangles: rising then falling; peaks move up in frequency
    peaks = w.argmax(axis=1)
    assert (np.diff(peaks) >= 0).all()
    for row in w[::16]:
        nz = row[row > 0]
        k = int(nz.argmax())
        assert (np.diff(nz[: k + 1]) >= 0).all() and (np.diff(nz[k:]) <= 0).all()
    # Slaney normalisation: each filter has unit area in Hz (discretely ≈ 1 for the wider, upper filters)
    area = w.sum(axis=1) * (24000 / 1024)
    assert np.abs(area[60:] - 1).max() < 0.05


def test_mel_spectrogram_shape_and_values():
    t = np.arange(24000) / 24000
    wav = torch.from_numpy((0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32))[None]
    mel = mel_spectrogram(wav)
    assert mel.shape == (1, (24000 + 768 - 1024) // 256 + 1, 128) and mel.dtype == torch.float32
    assert float(mel.min()) >= math.log(1e-5) - 1e-6
    # a 1 kHz tone peaks in the mel bin whose filter peaks nearest 1 kHz
    peak_bin = int(mel[0].mean(0).argmax())
    centre_hz = slaney_mel_filterbank().argmax(axis=1) * 24000 / 1024
    assert abs(centre_hz[peak_bin] - 1000) < 60


# ------------------------------------------------------------------------------------------------ loading

def test_speaker_encoder_strict_loading():
    cfg = Qwen3TTSConfig.load(str(TINY_BASE)).speaker_encoder
    sd = {k[len("speaker_encoder."):]: v for k, v in load_pt(str(TINY_BASE / "model.safetensors")).items()
          if k.startswith("speaker_encoder.")}
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    enc = load_strict(SpeakerEncoder(cfg), sd, "ckpt", "cpu", torch.float32)
    assert all(p.dtype == torch.float32 for p in enc.parameters())
    missing = dict(sd)
    del missing["asp.conv.bias"]
    with pytest.raises(WeightsError, match="missing tensors: asp.conv.bias"):
        load_strict(SpeakerEncoder(cfg), missing, "ckpt", "cpu", torch.float32)
    with pytest.raises(WeightsError, match="unexpected tensors: extra.weight"):
        load_strict(SpeakerEncoder(cfg), {**sd, "extra.weight": torch.zeros(1)}, "ckpt", "cpu", torch.float32)
    bad = dict(sd)
    bad["fc.bias"] = torch.zeros(3)
    with pytest.raises(WeightsError, match="tensor fc.bias has shape"):
        load_strict(SpeakerEncoder(cfg), bad, "ckpt", "cpu", torch.float32)


def test_speech_encoder_strict_loading(speech_encoder):
    tensors = load_pt(str(TINY_BASE / "speech_tokenizer" / "model.safetensors"))
    weights = {k[len("encoder."):]: v for k, v in tensors.items() if k.startswith("encoder.")}
    assert set(weights) == set(speech_encoder.state_dict())  # every encoder-side key is used, none left over
    cfg = MimiEncoderConfig.from_dict(SpeechTokenizerConfig.load(str(TINY_BASE)).encoder)
    gone = dict(weights)
    del gone["quantizer.acoustic_residual_vector_quantizer.layers.3.codebook.embed_sum"]
    with pytest.raises(WeightsError, match="missing tensors: quantizer.acoustic"):
        load_strict(SpeechEncoder(cfg), gone, "ckpt", "cpu", torch.float32)
    with pytest.raises(WeightsError, match="unexpected tensors: decoder_transformer.x"):
        load_strict(SpeechEncoder(cfg), {**weights, "decoder_transformer.x": torch.zeros(1)}, "ckpt", "cpu",
                    torch.float32)


def test_speech_encoder_lengths_and_errors(speech_encoder):
    rng = np.random.default_rng(3)
    for n in (1, 1919, 1920, 1921, 5000):
        codes = speech_encoder.encode(rng.standard_normal(n).astype(np.float32) * 0.1)
        assert codes.shape == (math.ceil(n / 1920), 16) and codes.dtype == torch.int64
        assert int(codes.min()) >= 0 and int(codes.max()) < 2048
    with pytest.raises(ValueError):
        speech_encoder.encode(np.zeros(0, np.float32))
    with pytest.raises(ValueError):
        speech_encoder.encode(np.zeros((2, 100), np.float32))


def test_speaker_embedding_too_short(speaker_encoder):
    with pytest.raises(ValueError, match="too short"):
        extract_speaker_embedding(speaker_encoder, np.zeros(300, np.float32))


# ------------------------------------------------------------------------------------------------ released sizes

def _released_speaker_config(enc_dim: int) -> SpeakerEncoderConfig:
    return SpeakerEncoderConfig(mel_dim=128, enc_dim=enc_dim, enc_channels=[512, 512, 512, 512, 1536],
                                enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                                enc_attention_channels=128, enc_res2net_scale=8, enc_se_channels=128,
                                sample_rate=24000)


@pytest.mark.parametrize("enc_dim,millions", [(1024, 8.9), (2048, 12.0)])
def test_released_speaker_encoder_size_on_meta(enc_dim, millions):
    with torch.device("meta"):
        enc = SpeakerEncoder(_released_speaker_config(enc_dim))
    n = sum(p.numel() for p in enc.parameters())
    assert abs(n / 1e6 - millions) <= 0.1
    assert enc.min_frames() == 5  # dilation 4, kernel 3 → reflect pad 4


def test_released_speech_encoder_size_on_meta():
    # released encoder_config: MimiConfig defaults plus the 12.5 Hz frame rate
    cfg = MimiEncoderConfig.from_dict({"_frame_rate": 12.5, "upsampling_ratios": [8, 6, 5, 4]})
    assert cfg.samples_per_frame == 1920 and cfg.downsample_stride == 2
    with torch.device("meta"):
        enc = SpeechEncoder(cfg, num_codebooks=16)
    params = sum(p.numel() for p in enc.parameters())
    buffers = sum(b.numel() for b in enc.buffers())
    assert abs(params / 1e6 - 39.4) <= 0.1 and abs(buffers / 1e6 - 16.8) <= 0.1
