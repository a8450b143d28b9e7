"""Speech-tokenizer encoder (wave → codes) for Base voice cloning, in plain PyTorch (model doc §11).

The released speech tokenizer embeds a Mimi encoder (SEANet convs → causal transformer → stride-2 downsample →
split RVQ). The reference runs it through transformers' `MimiModel`; this file re-implements the encoder side so
that the result does not depend on the installed transformers version (the class layout and key names of
transformers' Mimi changed in 5.x). State-dict names are the checkpoint's `encoder.*` keys with that prefix
stripped.

Attention is plain causal, with **no sliding window** by default: that is what the reference computes
(transformers 4.57.x builds a full causal mask for Mimi's SDPA/eager attention and ignores `sliding_window`),
whereas transformers 5.x applies the 250-frame window. The two differ only for references longer than
`sliding_window` frames at 25 Hz (10 s released); `use_sliding_window=True` gives the windowed variant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError
from .layers import LayerScale, apply_rope, rope_cos_sin

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

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
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
        if cfg.hidden_act not in _ACTIVATIONS:
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


# ----------------------------------------------------------------------------------------------------------------
# SEANet encoder
# ----------------------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------------------
# Transformer
# ----------------------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        # scale defaults to 1/sqrt(head_dim), as Mimi's
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block; both residual branches are scaled per channel (LayerScale)."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig, use_sliding_window: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.window = cfg.sliding_window if use_sliding_window else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        cos, sin = rope_cos_sin(torch.arange(t, device=x.device)[None], self.head_dim, self.rope_theta, x.dtype)
        mask = None
        if self.window is not None and t > self.window:
            pos = torch.arange(t, device=x.device)
            offset = pos[:, None] - pos[None, :]  # query − key
            mask = (offset >= 0) & (offset < self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


# ----------------------------------------------------------------------------------------------------------------
# Split residual vector quantizer (encode side)
# ----------------------------------------------------------------------------------------------------------------

class Codebook(nn.Module):
    """EMA codebook as stored: centroids = embed_sum / max(cluster_usage, 1e-5)."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.zeros(1))  # unused; kept so that the key loads strictly
        self.register_buffer("cluster_usage", torch.zeros(cfg.codebook_size))
        self.register_buffer("embed_sum", torch.zeros(cfg.codebook_size, cfg.codebook_dim))

    def centroids(self) -> torch.Tensor:
        return self.embed_sum.float() / self.cluster_usage.float().clamp(min=1e-5)[:, None]


class VQLayer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.codebook = Codebook(cfg)


class ResidualVQ(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VQLayer(cfg) for _ in range(n_layers))
        self.input_proj = self.output_proj = None
        if cfg.vector_quantization_hidden_dimension != cfg.hidden_size:
            dim = cfg.vector_quantization_hidden_dimension
            self.input_proj = nn.Conv1d(cfg.hidden_size, dim, 1, bias=False)
            self.output_proj = nn.Conv1d(dim, cfg.hidden_size, 1, bias=False)  # decode side; loaded, unused

    def encode(self, latents: torch.Tensor, n_codebooks: int) -> torch.Tensor:
        """latents [B, hidden, T] → codes [B, n_codebooks, T]: nearest centroid, subtract, repeat."""
        x = latents if self.input_proj is None else self.input_proj(latents)
        b, d, t = x.shape
        residual = x.transpose(1, 2).reshape(b * t, d).float()
        codes = []
        for layer in self.layers[:n_codebooks]:
            centroids = layer.codebook.centroids()
            # torch.cdist (its matmul path) as the reference uses, so near-ties resolve the same way
            idx = torch.cdist(residual[None], centroids[None], p=2)[0].argmin(dim=-1)
            residual = residual - F.embedding(idx, centroids)
            codes.append(idx.view(b, t))
        return torch.stack(codes, dim=1)


class SplitResidualVQ(nn.Module):
    """Codebook 0 from the semantic RVQ; the rest from the acoustic RVQ, both quantizing the same latents."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.n_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVQ(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = ResidualVQ(cfg, cfg.num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, latents: torch.Tensor, n_codebooks: int) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer.encode(latents, self.n_semantic)
        if n_codebooks > self.n_semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(latents, n_codebooks - self.n_semantic)
            codes = torch.cat([codes, acoustic], dim=1)
        return codes


# ----------------------------------------------------------------------------------------------------------------
# Whole encoder
# ----------------------------------------------------------------------------------------------------------------

class SpeechEncoder(nn.Module):
    """Mimi encoder: 24 kHz audio → the first `num_codebooks` RVQ codes per 80 ms frame."""

    def __init__(self, config: MimiEncoderConfig, num_codebooks: int = 16, use_sliding_window: bool = False) -> None:
        super().__init__()
        if not config.num_semantic_quantizers <= num_codebooks <= config.num_quantizers:
            raise ValueError(f"num_codebooks must be in [{config.num_semantic_quantizers}, {config.num_quantizers}], "
                             f"got {num_codebooks}")
        self.config, self.num_codebooks = config, num_codebooks
        self.encoder = SEANetEncoder(config)
        self.encoder_transformer = Transformer(config, use_sliding_window)
        stride = config.downsample_stride
        # edges repeat the last latent (replicate), unlike the SEANet convs' zero padding
        self.downsample = (MimiConv(config.hidden_size, config.hidden_size, 2 * stride, stride=stride, bias=False,
                                    causal=config.use_causal_conv, pad_mode="replicate") if stride > 1 else None)
        self.quantizer = SplitResidualVQ(config)

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def num_frames(self, num_samples: int) -> int:
        """Code frames for a clip: ceil(samples / 1920) released."""
        return -(-num_samples // self.samples_per_frame)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        """input_values [B, 1, samples] (one unpadded clip per row) → codes [B, num_codebooks, frames] int64."""
        x = self.encoder(input_values.to(self.encoder.layers[0].conv.weight.dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            x = self.downsample(x)
        return self.quantizer.encode(x.float(), self.num_codebooks)

    @torch.no_grad()
    def encode(self, wav24k: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Mono 24 kHz float audio [samples] → codes [T_ref, num_codebooks] int64 on CPU, T_ref = ceil(n / 1920).

        Same as the reference's EncodecFeatureExtractor + `encode` for a single clip: the samples as float32,
        an all-ones padding mask, codes trimmed to the frames the clip covers.
        """
        wav = torch.as_tensor(np.asarray(wav24k, dtype=np.float32) if not isinstance(wav24k, torch.Tensor)
                              else wav24k.float())
        if wav.dim() != 1:
            raise ValueError(f"expected mono audio of shape [samples], got shape {tuple(wav.shape)}")
        if wav.numel() == 0:
            raise ValueError("cannot encode empty reference audio")
        if not torch.isfinite(wav).all():
            raise ValueError("reference audio contains non-finite samples")
        device = next(self.parameters()).device
        codes = self.forward(wav.to(device)[None, None])[0]
        return codes[:, : self.num_frames(wav.numel())].transpose(0, 1).contiguous().cpu()
