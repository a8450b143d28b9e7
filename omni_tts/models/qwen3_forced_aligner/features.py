"""The encoder's input: Whisper's 128-bin log-mel spectrogram of 16 kHz audio, as the reference computes it.

The reference reads every clip through `librosa.resample` to 16 kHz, rescales a clip whose peak is above 1, and runs
transformers' `WhisperFeatureExtractor` (torch path: STFT 400/160 with a periodic Hann window, power spectrum without
its last frame, Slaney mel filters built in float64, log10 clamped at 1e-10 and to 8 below the clip's maximum). A
clip is always processed on its own: in a padded batch the reference's last frames of a shorter clip would see the
zero padding, so its result would depend on its batch neighbours.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..qwen3_tts.audio import resample_to
from .checkpoint_config import SAMPLE_RATE

N_FFT, HOP = 400, 160


def to_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float audio at any rate → float32 at 16 kHz within [-1, 1] (a louder clip is scaled down, not clipped)."""
    audio = np.asarray(audio, dtype=np.float32)
    if sample_rate != SAMPLE_RATE:
        audio = resample_to(audio, sample_rate, SAMPLE_RATE).astype(np.float32)
    if audio.size == 0:
        return audio
    peak = float(np.max(np.abs(audio)))
    if peak > 1.0:
        audio = audio / peak
    return np.clip(audio, -1.0, 1.0) if peak != 0.0 else audio


def num_frames(num_samples: int) -> int:
    """Feature frames of a 16 kHz clip: the STFT's frames less its last one."""
    return num_samples // HOP


@functools.lru_cache(maxsize=4)
def mel_filters(num_mel_bins: int) -> torch.Tensor:
    """[n_fft/2 + 1, num_mel_bins] Slaney-scale, Slaney-normalised triangular filters over 0-8 kHz (float64 → fp32)."""
    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        mel = 3.0 * f / 200.0
        log = f >= 1000.0
        mel[log] = 15.0 + np.log(f[log] / 1000.0) * (27.0 / np.log(6.4))
        return mel

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        hz = 200.0 * m / 3.0
        log = m >= 15.0
        hz[log] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m[log] - 15.0))
        return hz

    mel_edges = np.linspace(hz_to_mel(np.array([0.0]))[0], hz_to_mel(np.array([8000.0]))[0], num_mel_bins + 2)
    edges = mel_to_hz(mel_edges)
    fft_freqs = np.linspace(0, SAMPLE_RATE // 2, 1 + N_FFT // 2)
    diff = np.diff(edges)
    slopes = np.expand_dims(edges, 0) - np.expand_dims(fft_freqs, 1)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    filters *= np.expand_dims(2.0 / (edges[2:num_mel_bins + 2] - edges[:num_mel_bins]), 0)
    return torch.from_numpy(filters).to(torch.float32)


def log_mel(audio_16k: np.ndarray, num_mel_bins: int) -> torch.Tensor:
    """[num_mel_bins, frames] float32 features of one clip (at least one STFT hop long)."""
    wave = torch.from_numpy(np.ascontiguousarray(audio_16k, dtype=np.float32))[None]
    stft = torch.stft(wave, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = stft[..., :-1].abs() ** 2
    log_spec = torch.clamp(mel_filters(num_mel_bins).T @ power, min=1e-10).log10()
    peak = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]
    log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0
    return log_spec[0]
