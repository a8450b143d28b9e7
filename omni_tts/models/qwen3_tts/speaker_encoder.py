"""Speaker encoder of the Base checkpoints: log-mel front end + ECAPA-TDNN x-vector (model doc §9).

Parameter names equal the checkpoint's `speaker_encoder.*` keys with the prefix stripped. Unlike SpeechBrain's
ECAPA there is no BatchNorm: every TDNN is Conv1d (bias, "same" reflect padding) → ReLU.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .audio import SAMPLE_RATE
from .checkpoint_config import SpeakerEncoderConfig
from .prompt import RequestError

# Mel constants are fixed in the reference (not read from the config).
N_FFT = 1024
HOP = 256
WIN = 1024
N_MELS = 128
FMIN = 0.0
FMAX = 12000.0
REFLECT_PAD = (N_FFT - HOP) // 2  # 384: with center=False this centres frames like librosa's center=True would


# ----------------------------------------------------------------------------------------------------------------
# Mel front end
# ----------------------------------------------------------------------------------------------------------------

def _hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3
    mels = hz / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    above = hz >= min_log_hz
    mels = np.where(above, min_log_mel + np.log(np.maximum(hz, min_log_hz) / min_log_hz) / logstep, mels)
    return mels


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    f_sp = 200.0 / 3
    freqs = f_sp * mels
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    above = mels >= min_log_mel
    return np.where(above, min_log_hz * np.exp(logstep * (mels - min_log_mel)), freqs)


def slaney_mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS,
                          fmin: float = FMIN, fmax: float = FMAX) -> np.ndarray:
    """Triangular mel filters with Slaney area normalisation, [n_mels, n_fft // 2 + 1] float32.

    Equals `librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)` (htk=False,
    norm="slaney"), including its float32 rounding: each row is computed in float64 and stored as float32, then
    scaled by the float64 area norm.
    """
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_points = np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2)
    mel_f = _mel_to_hz_slaney(mel_points)
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2:n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, np.newaxis]
    return weights


@lru_cache(maxsize=4)
def _mel_basis(device: str) -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filterbank()).to(device)


def mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """Log-mel features of 24 kHz audio [B, samples] → [B, frames, 128], frames = (samples + 768 - 1024) // 256 + 1.

    Reflect-pad 384, STFT (periodic Hann 1024, hop 256, center=False), magnitude sqrt(re² + im² + 1e-9), Slaney mel,
    log(clamp(·, 1e-5)). Computed in float32 whatever the input dtype.
    """
    if wav.dim() != 2:
        raise ValueError(f"mel_spectrogram expects [batch, samples], got shape {tuple(wav.shape)}")
    wav = wav.float()
    wav = F.pad(wav.unsqueeze(1), (REFLECT_PAD, REFLECT_PAD), mode="reflect").squeeze(1)
    window = torch.hann_window(WIN, device=wav.device)  # periodic by default
    spec = torch.stft(wav, N_FFT, hop_length=HOP, win_length=WIN, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(_mel_basis(str(wav.device)), mag)
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# ECAPA-TDNN
# ----------------------------------------------------------------------------------------------------------------

def _conv(cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    # "same" output length with reflected edges, as the released weights were trained with
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Conv1d → ReLU (no BatchNorm in this ECAPA variant)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Splits channels into `scale` groups; group 0 passes through, group i ≥ 1 is convolved after adding the
    previous group's output (hierarchical receptive fields)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        if channels % scale:
            raise ValueError(f"Res2Net channels {channels} must be divisible by scale {scale}")
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        prev = None
        for i in range(1, self.scale):
            inp = parts[i] if prev is None else parts[i] + prev
            prev = self.blocks[i - 1](inp)
            outs.append(prev)
        return torch.cat(outs, dim=1)


class SqueezeExcitation(nn.Module):
    """Channel gates from the time-averaged input: conv → ReLU → conv → sigmoid."""

    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """TDNN k1 → Res2Net → TDNN k1 → SE, plus the block input."""

    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        if cin != cout:
            # the residual is added without a projection in the released design
            raise ValueError(f"SE-Res2Net block needs equal in/out channels, got {cin} → {cout}")
        self.tdnn1 = TDNN(cin, cout, 1, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = TDNN(cout, cout, 1, 1)
        self.se_block = SqueezeExcitation(cout, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _weighted_stats(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time of x [B, C, T] under weights w (summing to 1 over T)."""
    mean = (w * x).sum(dim=2)
    std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2).clamp(min=eps))
    return mean, std


class AttentiveStatsPooling(nn.Module):
    """Attention over time whose scores also see the utterance's global mean/std; returns [mean ‖ std]."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        uniform = torch.full((1, 1, frames), 1.0 / frames, dtype=x.dtype, device=x.device)
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        scores = self.conv(torch.tanh(self.tdnn(context)))
        mean, std = _weighted_stats(x, torch.softmax(scores, dim=2))
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN x-vector: mel [B, frames, mel_dim] → [B, enc_dim]."""

    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        if not len(ch) == len(ks) == len(dil) or len(ch) < 3:
            raise ValueError("speaker encoder needs ≥ 3 equally long enc_channels / enc_kernel_sizes / enc_dilations")
        self.config = config
        self.blocks = nn.ModuleList([TDNN(config.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SERes2NetBlock(ch[i - 1], ch[i], config.enc_res2net_scale, config.enc_se_channels,
                                              ks[i], dil[i]))
        # multi-layer feature aggregation: the SE-Res2Net outputs concatenated must give enc_channels[-1]
        if sum(ch[1:-1]) != ch[-1]:
            raise ValueError(f"enc_channels[-1] ({ch[-1]}) must equal the sum of the SE-Res2Net widths "
                             f"({sum(ch[1:-1])})")
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPooling(ch[-1], config.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, config.enc_dim)

    def min_frames(self) -> int:
        """Fewest mel frames the reflect-padded convs accept (reflect padding must be shorter than the input)."""
        pads = [m.dilation[0] * (m.kernel_size[0] - 1) for m in self.modules() if isinstance(m, nn.Conv1d)]
        return max(math.ceil(p / 2) for p in pads) + 1

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        if mel.dim() != 3 or mel.shape[-1] != self.config.mel_dim:
            raise ValueError(f"expected mel [batch, frames, {self.config.mel_dim}], got {tuple(mel.shape)}")
        if mel.shape[1] < self.min_frames():
            raise ValueError(f"reference audio too short: {mel.shape[1]} mel frames, need ≥ {self.min_frames()}")
        x = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)


def min_samples_for_embedding(encoder: SpeakerEncoder) -> int:
    """Shortest 24 kHz clip that yields enough mel frames for `encoder` (released config: 1280 samples)."""
    # the waveform's own reflect padding also needs more than REFLECT_PAD samples
    return max((encoder.min_frames() - 1) * HOP + N_FFT - 2 * REFLECT_PAD, REFLECT_PAD + 1)


@torch.no_grad()
def extract_speaker_embedding(encoder: SpeakerEncoder, wav24k: np.ndarray) -> torch.Tensor:
    """x-vector [enc_dim] of mono 24 kHz float audio, in the encoder's dtype and on its device; a clip too short for
    the encoder's convolutions is the request's fault: RequestError('ref_audio')."""
    wav = np.asarray(wav24k, dtype=np.float32)
    if wav.ndim != 1:
        raise ValueError(f"expected mono audio of shape [samples], got shape {wav.shape}")
    need = min_samples_for_embedding(encoder)
    if wav.shape[0] < need:
        raise RequestError("ref_audio", f"ref_audio is too short for the speaker encoder: {wav.shape[0]} samples "
                                        f"at 24 kHz ({wav.shape[0] / SAMPLE_RATE:.3f} s), it needs at least {need} "
                                        f"({need / SAMPLE_RATE:.3f} s)")
    param = next(encoder.parameters())
    mel = mel_spectrogram(torch.from_numpy(wav).unsqueeze(0).to(param.device))
    return encoder(mel.to(param.dtype))[0]
