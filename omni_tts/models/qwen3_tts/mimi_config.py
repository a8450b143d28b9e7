"""The speech encoder's configuration: the encoder-side fields of a transformers `MimiConfig`, defaults filled in."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .checkpoint_config import ConfigError

# transformers' MimiConfig defaults: the released encoder_config leaves most fields at these (model doc §11)
MIMI_DEFAULTS: dict[str, Any] = dict(
    sampling_rate=24000, audio_channels=1, hidden_size=512, num_filters=64, num_residual_layers=1,
    upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3, residual_kernel_size=3,
    dilation_growth_rate=2, use_causal_conv=True, pad_mode="constant", compress=2, use_conv_shortcut=False,
    codebook_size=2048, codebook_dim=256, num_quantizers=32, num_semantic_quantizers=1,
    vector_quantization_hidden_dimension=256, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8,
    num_key_value_heads=None, head_dim=None, hidden_act="gelu", norm_eps=1e-5, rope_theta=10000.0,
    sliding_window=250, attention_bias=False,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # transformers' "gelu" is the exact erf form
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class MimiEncoderConfig:
    """The encoder-side fields of a transformers `MimiConfig` dict (`speech_tokenizer/config.json` →
    `encoder_config`), with transformers' defaults filled in."""
    sampling_rate: int
    audio_channels: int
    hidden_size: int
    num_filters: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    use_causal_conv: bool
    pad_mode: str
    compress: int
    use_conv_shortcut: bool
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    vector_quantization_hidden_dimension: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    norm_eps: float
    rope_theta: float
    sliding_window: int | None
    attention_bias: bool
    frame_rate: float

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "speech_tokenizer/config.json") -> "MimiEncoderConfig":
        v = {k: data.get(k) if data.get(k) is not None else d for k, d in MIMI_DEFAULTS.items()}
        # transformers 5.x writes rope settings as `rope_parameters`
        rope = data.get("rope_parameters")
        if data.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is not None:
            v["rope_theta"] = rope["rope_theta"]
        v["num_key_value_heads"] = v["num_key_value_heads"] or v["num_attention_heads"]
        v["head_dim"] = v["head_dim"] or v["hidden_size"] // v["num_attention_heads"]
        ratios = tuple(int(r) for r in v["upsampling_ratios"])
        v["upsampling_ratios"] = ratios
        # 4.57 stores the frame rate as `_frame_rate`; without it MimiConfig derives it with a stride-2 downsample
        frame_rate = data.get("_frame_rate", data.get("frame_rate"))
        if frame_rate is None:
            frame_rate = v["sampling_rate"] / (math.prod(ratios) * 2)
        v["frame_rate"] = float(frame_rate)
        cfg = cls(**v)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{path}: encoder_config.hidden_act {cfg.hidden_act!r} is not supported")
        if cfg.audio_channels != 1:
            raise ConfigError(f"{path}: encoder_config.audio_channels must be 1, got {cfg.audio_channels}")
        if cfg.pad_mode not in ("constant", "replicate", "reflect"):
            raise ConfigError(f"{path}: encoder_config.pad_mode {cfg.pad_mode!r} is not supported")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{path}: encoder_config.num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < cfg.num_semantic_quantizers < cfg.num_quantizers:
            raise ConfigError(f"{path}: encoder_config.num_semantic_quantizers must be in [1, num_quantizers)")
        if cfg.downsample_stride not in (1, 2):
            # transformers 4.57 hard-codes stride 2 for this conv (5.x derives it), so other ratios are ambiguous
            raise ConfigError(f"{path}: encoder_config frame rate {cfg.frame_rate} needs a SEANet→codec rate ratio "
                              f"of 1 or 2, got {cfg.encodec_frame_rate / cfg.frame_rate}")
        return cfg

    @property
    def encodec_frame_rate(self) -> int:
        """Frame rate after the SEANet convs (25 Hz released)."""
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def downsample_stride(self) -> int:
        """Stride of the conv that takes the SEANet rate to the codec rate (2 released; 1 means no such conv)."""
        return int(self.encodec_frame_rate / self.frame_rate)

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * self.downsample_stride
