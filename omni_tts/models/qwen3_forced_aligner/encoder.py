"""The aligner's audio encoder: three stride-2 convolutions per 100-frame chunk, then a transformer whose attention
stays inside windows of `n_window_infer` mel frames (`model doc`: Qwen3-ASR's AuT encoder).

The windows are the encoder's design (the official vLLM backend and flash attention pass them as `cu_seqlens`); the
reference's transformers backend drops them on its SDPA/eager paths, which differs only for clips longer than one
window (8 s): the goldens of longer clips are made with the windows applied.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint_config import AudioEncoderConfig


def conv_output_length(frames: int) -> int:
    """Encoder positions of a chunk of `frames` mel frames (three stride-2 convolutions)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def encoder_length(frames: int, chunk: int) -> int:
    """Encoder positions (= audio tokens in the prompt) of a clip of `frames` mel frames."""
    full, rest = divmod(frames, chunk)
    return full * conv_output_length(chunk) + (conv_output_length(rest) if rest else 0)


def _sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(d, d))
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def attend(self, x: torch.Tensor, window: int) -> torch.Tensor:
        # x: [N, d]; attention within consecutive windows of `window` positions (the last may be shorter)
        attn = self.self_attn
        n, d = x.shape
        q, k, v = (proj(x).view(n, self.num_heads, d // self.num_heads).transpose(0, 1)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        out = torch.empty_like(q)
        full = n // window * window
        if full:  # the full windows as one batch
            def windows(t: torch.Tensor) -> torch.Tensor:
                return t[:, :full].reshape(self.num_heads, full // window, window, -1).transpose(0, 1)
            o = F.scaled_dot_product_attention(windows(q), windows(k), windows(v))
            out[:, :full] = o.transpose(0, 1).reshape(self.num_heads, full, -1)
        if full < n:
            out[:, full:] = F.scaled_dot_product_attention(q[None, :, full:], k[None, :, full:], v[None, :, full:])[0]
        return attn.out_proj(out.transpose(0, 1).reshape(n, d))

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:
        x = x + self.attend(self.self_attn_layer_norm(x), window)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Weights under `thinker.audio_tower.`; one clip's features [mel, frames] → [positions, output_dim]."""

    CONV_BATCH = 500  # chunks per convolution call, as the reference splits them (bounds the activations' memory)

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        freq = ((((cfg.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2)
        self.conv_out = nn.Linear(hidden * freq, cfg.d_model, bias=False)
        self.register_buffer("positional_embedding", _sinusoids(cfg.max_source_positions, cfg.d_model),
                             persistent=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    @property
    def chunk_frames(self) -> int:
        return 2 * self.cfg.n_window

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        frames = features.shape[1]
        chunk = self.chunk_frames
        lengths = [chunk] * (frames // chunk) + ([frames % chunk] if frames % chunk else [])
        # every chunk is zero-padded to the longest one: a tail chunk's last positions see that padding
        padded = nn.utils.rnn.pad_sequence(list(features.T.split(lengths)), batch_first=True).transpose(1, 2)
        convolved = []
        for part in padded[:, None].split(self.CONV_BATCH):
            x = F.gelu(self.conv2d1(part))
            x = F.gelu(self.conv2d2(x))
            convolved.append(F.gelu(self.conv2d3(x)))
        x = torch.cat(convolved)
        b, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
        x = x + self.positional_embedding[:t].to(x.dtype)
        x = torch.cat([x[i, :conv_output_length(n)] for i, n in enumerate(lengths)])
        window = t * (self.cfg.n_window_infer // chunk)
        for layer in self.layers:
            x = layer(x, window)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))
