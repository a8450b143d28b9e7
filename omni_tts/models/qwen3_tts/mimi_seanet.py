"""The speech encoder's SEANet convolutions: 24 kHz audio → latents at the SEANet frame rate (25 Hz released)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mimi_config import MimiEncoderConfig


class MimiConv(nn.Module):
    """Conv1d with Mimi's padding: causal convs pad (k_eff − stride) on the left, plus on the right whatever makes
    the last window complete, so an input of L samples gives exactly ceil(L / stride) outputs."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 causal: bool = True, pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.causal, self.pad_mode, self.stride = causal, pad_mode, stride
        self.padding_total = (kernel - 1) * dilation + 1 - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        extra = -(-length // self.stride) * self.stride - length  # complete the last stride
        if self.causal:
            left, right = self.padding_total, extra
        else:
            right = self.padding_total // 2
            left, right = self.padding_total - right, right + extra
        return self.conv(_pad(x, left, right, self.pad_mode))


def _pad(x: torch.Tensor, left: int, right: int, mode: str) -> torch.Tensor:
    if left == right == 0:
        return x
    if mode != "reflect" or x.shape[-1] > max(left, right):
        return F.pad(x, (left, right), mode=mode)
    # reflect needs input longer than the pad: zero-extend first, then drop that extension (as transformers does)
    extra = max(left, right) - x.shape[-1] + 1
    padded = F.pad(F.pad(x, (0, extra)), (left, right), mode="reflect")
    return padded[..., : padded.shape[-1] - extra]


class ResnetBlock(nn.Module):
    """ELU → conv k (dilated) → ELU → conv 1, plus the input (SEANet residual unit)."""

    def __init__(self, cfg: MimiEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        conv = dict(causal=cfg.use_causal_conv, pad_mode=cfg.pad_mode)
        # indices 1 and 3 hold the convs, as in the checkpoint's `block.{1,3}` keys
        self.block = nn.ModuleList([
            nn.ELU(), MimiConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation, **conv),
            nn.ELU(), MimiConv(hidden, dim, 1, **conv),
        ])
        self.shortcut = MimiConv(dim, dim, 1, **conv) if cfg.use_conv_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return (x if self.shortcut is None else self.shortcut(x)) + y


class SEANetEncoder(nn.Module):
    """conv → per ratio (smallest first): residual units, ELU, strided conv doubling channels → ELU → conv."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        conv = dict(causal=cfg.use_causal_conv, pad_mode=cfg.pad_mode)
        layers: list[nn.Module] = [MimiConv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, **conv)]
        channels = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            for j in range(cfg.num_residual_layers):
                layers.append(ResnetBlock(cfg, channels, cfg.dilation_growth_rate ** j))
            layers += [nn.ELU(), MimiConv(channels, channels * 2, ratio * 2, stride=ratio, **conv)]
            channels *= 2
        layers += [nn.ELU(), MimiConv(channels, cfg.hidden_size, cfg.last_kernel_size, **conv)]
        self.layers = nn.ModuleList(layers)  # ELUs keep their slots so indices match the checkpoint keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
