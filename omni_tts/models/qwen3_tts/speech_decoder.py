"""Qwen3-TTS-12Hz speech-tokenizer decoder: 16 codebooks x T frames -> 24 kHz waveform (model doc §10).

codes [B, 16, T] -> RVQ decode [B, codebook_dim, T] -> causal conv -> windowed transformer -> 2 x (transposed conv
+ ConvNeXt), 4x -> waveform decoder (4 SnakeBeta / transposed-conv / residual-unit blocks, 480x) -> [B, T*1920].

Every layer is causal, so the decoder can run as an exact streaming decoder: each layer that looks at the past
keeps exactly the past it needs in a `DecoderStreamState`, and a chunk of F frames emits F*1920 new samples whose
concatenation over chunks equals the one-pass decode. The one-pass `forward` is the same code run on a fresh state
(so the two paths cannot drift apart).

What each layer keeps between chunks:
  - causal conv (kernel k, dilation d): its last (k-1)*d input samples (zeros before the stream starts, which is
    exactly the left zero padding of a one-pass decode);
  - causal transposed conv (kernel k, stride s): the k-s output samples that the next input still overlap-adds
    into, kept WITHOUT bias (the bias is added once, when a sample is emitted);
  - attention layer: the last `sliding_window - 1` rotated keys / values (the window includes the current frame),
    right-aligned in a fixed-size buffer; slots before the start of the stream are masked out;
  - `position`: frames already decoded per request, i.e. the absolute RoPE position of the next frame.
All state tensors are batch-first and fixed-size, and are updated in place, so states of requests at different
stream offsets can be stacked into one batch (`DecoderStreamState.stack`) and split again (`unbind`).

Parameter / buffer names equal the checkpoint's `decoder.*` keys without the `decoder.` prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import SpeechDecoderConfig
from .layers import LayerScale, RMSNorm, apply_rope, rope_cos_sin

__all__ = ["DecoderStreamState", "SpeechDecoder"]


# ----------------------------------------------------------------------------------------------------------------
# Streaming state
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class DecoderStreamState:
    """Per-request streaming state of a `SpeechDecoder`; every tensor has the batch on dim 0.

    `SpeechDecoder.decode_chunk` updates the tensors in place (buffers never change shape or address).
    """
    position: Tensor       # [B] int64: frames decoded so far = absolute position of the next frame
    conv: list[Tensor]     # per causal conv with k > 1: [B, C_in, (k-1)*d] last input samples
    overlap: list[Tensor]  # per transposed conv with k > s: [B, C_out, k-s] pending output samples, no bias
    keys: list[Tensor]     # per attention layer: [B, kv_heads, W-1, head_dim] rotated keys, oldest first
    values: list[Tensor]   # per attention layer: [B, kv_heads, W-1, head_dim]

    @property
    def batch_size(self) -> int:
        return self.position.shape[0]

    def _tensors(self) -> list[Tensor]:
        return [self.position, *self.conv, *self.overlap, *self.keys, *self.values]

    def _from_tensors(self, tensors: list[Tensor]) -> "DecoderStreamState":
        """A state of the same layout as `self` holding `tensors` (in `_tensors` order)."""
        it = iter(tensors)
        position = next(it)
        conv = [next(it) for _ in self.conv]
        overlap = [next(it) for _ in self.overlap]
        keys = [next(it) for _ in self.keys]
        values = [next(it) for _ in self.values]
        return DecoderStreamState(position, conv, overlap, keys, values)

    @staticmethod
    def stack(states: list["DecoderStreamState"]) -> "DecoderStreamState":
        """Concatenate the states of several requests (any stream offsets) into one batch; copies."""
        if not states:
            raise ValueError("DecoderStreamState.stack needs at least one state")
        columns = zip(*(s._tensors() for s in states))
        return states[0]._from_tensors([torch.cat(column, dim=0) for column in columns])

    def unbind(self) -> list["DecoderStreamState"]:
        """Split a batched state into independent batch-1 states (copies, so the batch can be freed)."""
        return [self.select(i) for i in range(self.batch_size)]

    def select(self, i: int) -> "DecoderStreamState":
        """Row `i` as an independent batch-1 state (a copy)."""
        return self._from_tensors([t[i:i + 1].clone() for t in self._tensors()])


# ----------------------------------------------------------------------------------------------------------------
# Building blocks (all streaming-aware: `state` is the whole decoder state, `slot` picks this layer's entry)
# ----------------------------------------------------------------------------------------------------------------
class CausalConv1d(nn.Module):
    """Conv1d left-padded by (k-1)*d; the padding is the carried history (zeros at the start of a stream)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.history = (kernel_size - 1) * dilation
        self.slot = -1  # index into DecoderStreamState.conv, assigned by SpeechDecoder

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, C_in, n] -> [B, C_out, n], or channels-last [B, C_in, 1, n] -> [B, C_out, 1, n] (see DecoderBlock)
        if self.history > 0:
            hist = state.conv[self.slot]                 # [B, C_in, history]
            # cat keeps channels-last only if both inputs have it
            past = hist[:, :, None].contiguous(memory_format=torch.channels_last) if x.dim() == 4 else hist
            x = torch.cat([past, x], dim=-1)             # [B, C_in, (1,) history + n]
            hist.copy_(x[..., x.shape[-1] - self.history:].flatten(2))  # cat made a new tensor: no aliasing
        conv = self.conv
        if x.dim() == 4:                                 # its memory is [B, 1, n, C_in]
            if conv.kernel_size[0] == 1:                 # a GEMM over the rows (conv2d: a slow path, NCHW out)
                return F.linear(x.permute(0, 2, 3, 1), conv.weight[:, :, 0], conv.bias).permute(0, 3, 1, 2)
            weight = conv.weight[:, :, None].contiguous(memory_format=torch.channels_last)
            return F.conv2d(x, weight, conv.bias, dilation=(1, conv.dilation[0]), groups=conv.groups)
        if conv.out_channels == 1 and x.device.type == "cpu":
            return self._to_one_channel(x)
        return conv(x)

    def _to_one_channel(self, x: Tensor) -> Tensor:
        """The waveform conv (C_in -> 1) as k shifted [1, C_in] x [C_in, n] products: oneDNN's kernel for one output
        channel is ~4x slower on a CPU (1.23 vs 0.28 ms for 28 channels x 15360 samples)."""
        conv, n = self.conv, x.shape[-1] - self.history
        weight, dilation = conv.weight.expand(x.shape[0], -1, -1, -1), conv.dilation[0]  # [B, 1, C_in, k]
        out = torch.baddbmm(conv.bias.view(1, 1, 1), weight[..., 0], x[..., :n])        # [B, 1, n]
        for j in range(1, conv.kernel_size[0]):
            out.baddbmm_(weight[..., j], x[..., j * dilation:j * dilation + n])
        return out


# CausalConvTranspose1d runs as a GEMM up to this many input samples (batch × length): a first packet's 1-frame
# decode of the medium preset 20 → 16 ms on one CPU thread; larger inputs gain nothing over PyTorch's kernels
GEMM_MAX_INPUTS = 64


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d(k, s) with the last k-s output samples dropped; n inputs -> n*s outputs.

    Streaming: output samples [n*s, n*s + k-s) of a chunk are incomplete (the next input adds to them), so they are
    carried to the next chunk without bias and overlap-added there.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.overlap = kernel_size - stride
        self.slot = -1  # index into DecoderStreamState.overlap (only when overlap > 0)

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, C_in, n] -> [B, C_out, n*s]
        n_out = x.shape[-1] * self.stride
        y = self._transposed(x)                                                 # [B, C_out, n*s + overlap]
        if self.overlap == 0:
            return y + self.conv.bias[:, None]
        tail = state.overlap[self.slot]                                         # [B, C_out, overlap]
        y[..., :self.overlap] += tail
        tail.copy_(y[..., n_out:])
        return y[..., :n_out] + self.conv.bias[:, None]

    def _transposed(self, x: Tensor) -> Tensor:
        """conv_transpose1d without bias. Kernels here are 1 or 2 strides long (k = m*s): for short inputs one GEMM
        gives every input sample's k outputs, and output block t sums input t's first stride, input t-1's second, …
        (on a CPU PyTorch's own transposed conv takes a slow path there, ~0.7 ms per call, mostly weight reads)."""
        weight, s = self.conv.weight, self.stride                               # [C_in, C_out, k]
        c_out, k = weight.shape[1], weight.shape[2]
        if k % s or x.shape[0] * x.shape[-1] > GEMM_MAX_INPUTS:
            return F.conv_transpose1d(x, weight, None, stride=s)
        (b, c_in, n), m = x.shape, k // s
        # one [B*n, C_in] GEMM: a batched matmul would broadcast (copy) the weight once per row
        z = torch.mm(x.transpose(1, 2).reshape(b * n, c_in), weight.reshape(c_in, c_out * k))  # [B*n, C_out*k]
        z = z.view(b, n, c_out, m, s).permute(0, 2, 3, 1, 4)                              # [B, C_out, m, n, s]
        if m == 1:
            return z.reshape(b, c_out, n * s)
        y = z.new_zeros(b, c_out, n + m - 1, s)
        for i in range(m):
            y[:, :, i:i + n] += z[:, :, i]
        return y.view(b, c_out, (n + m - 1) * s)


class SnakeBeta(nn.Module):
    """x + sin²(x·e^α) / (e^β + 1e-9), α and β per channel in log scale."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, n]; the reference's op order (x + c·sin²(x·α)) so fp32 results agree to the last bits, with
        # the audio-rate temporaries updated in place: these activations are memory-bound on a CPU
        per_channel = (1, -1) + (1,) * (x.dim() - 2)  # [B, C, n] or channels-last [B, C, 1, n]
        alpha = torch.exp(self.alpha).view(per_channel)
        scale = 1.0 / (torch.exp(self.beta).view(per_channel) + 1e-9)
        y = x * alpha
        if y.device.type == "cpu" and y.dtype == torch.float32:
            # numpy's SIMD float32 sin is 2.6x torch's CPU sin (0.52 vs 1.37 ns per value on AVX-512), which was
            # an eighth of a decoder call; the two differ by at most one unit in the last place
            samples = y.numpy()
            np.sin(samples, out=samples)
        else:
            y = y.sin_()
        return y.square_().mul_(scale).add_(x)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm -> Linear 4x -> exact GELU -> Linear -> x gamma, + residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, C, n]
        h = self.dwconv(x, state).transpose(1, 2)                     # [B, n, C]
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))          # exact (erf) GELU
        return x + (self.gamma * h).transpose(1, 2)


class UpsampleStage(nn.ModuleList):
    """upsample.{i}: [0] transposed conv (k = s = ratio), [1] ConvNeXt."""

    def __init__(self, dim: int, ratio: int):
        super().__init__([CausalConvTranspose1d(dim, dim, ratio, ratio), ConvNeXtBlock(dim)])

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        return self[1](self[0](x, state), state)


class ResidualUnit(nn.Module):
    """SnakeBeta -> causal conv k7 dilated -> SnakeBeta -> conv k1, + residual."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        h = self.conv1(self.act1(x), state)
        return x + self.conv2(self.act2(h), state)


# Residual units of at most this many channels run channels-last on a CPU (as [B, C, 1, n] conv2d): oneDNN's
# layout for few channels over many samples; the medium preset's 28- and 56-channel units, 1 x 8-frame call:
# 14.6 -> 10.8 and 13.7 -> 11.9 ms, 16 x 1: 37.2 -> 21.8 and 27.8 -> 22.5 ms; at 112 channels no gain
CHANNELS_LAST_MAX_DIM = 64


class DecoderBlock(nn.Module):
    """decoder.{1..4}: block = [SnakeBeta, transposed conv (2r, r), residual units with dilation 1, 3, 9]."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate),
                                    *(ResidualUnit(out_dim, d) for d in (1, 3, 9))])
        self.channels_last = out_dim <= CHANNELS_LAST_MAX_DIM

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, in_dim, n] -> [B, out_dim, n*rate]
        x = self.block[1](self.block[0](x), state)
        channels_last = self.channels_last and x.device.type == "cpu"
        if channels_last:
            x = x[:, :, None].contiguous(memory_format=torch.channels_last)
        for unit in self.block[2:]:
            x = unit(x, state)
        return x[:, :, 0].contiguous() if channels_last else x


# ----------------------------------------------------------------------------------------------------------------
# Residual vector quantizer (decode only)
# ----------------------------------------------------------------------------------------------------------------
class Codebook(nn.Module):
    """Codebook vectors are embedding_sum / max(cluster_usage, 1e-5) (EMA k-means statistics, stored as such)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size), requires_grad=False)
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim), requires_grad=False)

    def forward(self, codes: Tensor) -> Tensor:
        # codes: [B, T] -> [B, T, dim]; gather first, then divide (elementwise, so identical to dividing the table)
        usage = self.cluster_usage.clamp(min=1e-5)
        return F.embedding(codes, self.embedding_sum) / F.embedding(codes, usage[:, None])


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)  # checkpoint name


class ResidualVQ(nn.Module):
    """Sum of the codebook vectors of n_q codebooks, projected by a k1 conv to `output_dim`.

    `input_proj` is the encoder-side projection; decoding never uses it, it is kept so loading is strict.
    """

    def __init__(self, n_q: int, size: int, dim: int, output_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(output_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, output_dim, 1, bias=False)
        self.vq = nn.ModuleDict({"layers": nn.ModuleList(VectorQuantizer(size, dim) for _ in range(n_q))})

    def forward(self, codes: Tensor) -> Tensor:
        # codes: [B, n_q, T] -> [B, output_dim, T]
        summed = 0
        for q, layer in enumerate(self.vq["layers"]):  # fixed loop over codebooks, in the reference's order
            summed = summed + layer._codebook(codes[:, q])  # [B, T, dim]
        return self.output_proj(summed.transpose(1, 2))


class SplitRVQ(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) have separate output projections; their outputs add."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVQ(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def forward(self, codes: Tensor) -> Tensor:
        # codes: [B, Q, T] -> [B, codebook_dim, T]
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


# ----------------------------------------------------------------------------------------------------------------
# Windowed transformer
# ----------------------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Sliding-window causal attention over [carried keys (W-1 slots) ++ this chunk's keys]."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # heads * head_dim need not equal hidden (released: 16 x 64 = 1024 vs hidden 512)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.layer = -1  # index into DecoderStreamState.keys / values

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, F, hidden]; cos/sin: [B, 1, F, head_dim]; mask: [B, 1, F, W-1+F] (True = attend)
        b, f, _ = x.shape
        q = self.q_proj(x).view(b, f, self.n_heads, self.head_dim).transpose(1, 2)     # [B, H, F, D]
        k = self.k_proj(x).view(b, f, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KVH, F, D]
        v = self.v_proj(x).view(b, f, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        k_cache, v_cache = state.keys[self.layer], state.values[self.layer]   # [B, KVH, W-1, D]
        k = torch.cat([k_cache, k], dim=2)                                   # [B, KVH, W-1+F, D]
        v = torch.cat([v_cache, v], dim=2)
        k_cache.copy_(k[:, :, f:])  # keep the newest W-1 (already rotated at their absolute positions)
        v_cache.copy_(v[:, :, f:])

        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)  # [B, H, F, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, f, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, state: DecoderStreamState) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, state))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """Linear latent -> hidden, windowed transformer layers, RMSNorm, Linear hidden -> latent."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, F, latent] -> [B, F, latent]
        f = x.shape[1]
        cached = self.cfg.sliding_window - 1
        offsets = torch.arange(f, device=x.device)
        positions = state.position[:, None] + offsets                                    # [B, F] absolute
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)

        # Key slot c of [cache ++ chunk] holds absolute position start - cached + c (cache right-aligned).
        # Query i (position start + i) sees slots c with i <= c <= i + cached (the window, itself included),
        # and only slots at positions >= 0 (the cache is not full yet near the start of the stream).
        slots = torch.arange(cached + f, device=x.device)
        rel = slots[None, :] - offsets[:, None]                                          # [F, W-1+F]
        window = (rel >= 0) & (rel <= cached)
        started = slots[None, :] >= (cached - state.position)[:, None]                   # [B, W-1+F]
        mask = (window[None] & started[:, None])[:, None]                                # [B, 1, F, W-1+F]

        x = self.input_proj(x)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, state)
        return self.output_proj(self.norm(x))


# ----------------------------------------------------------------------------------------------------------------
# Decoder
# ----------------------------------------------------------------------------------------------------------------
class SpeechDecoder(nn.Module):
    """The speech-tokenizer decoder, one-pass (`forward`) and exact streaming (`decode_chunk`)."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.samples_per_frame = cfg.samples_per_frame
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, kernel_size=3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(UpsampleStage(cfg.latent_dim, r) for r in cfg.upsampling_ratios)
        n_blocks = len(cfg.upsample_rates)
        dims = [cfg.decoder_dim // 2 ** i for i in range(n_blocks + 1)]
        self.decoder = nn.ModuleList([
            CausalConv1d(cfg.latent_dim, dims[0], kernel_size=7),
            *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv1d(dims[-1], 1, kernel_size=7),
        ])

        # Give every stateful layer its slot in DecoderStreamState (module registration order).
        self._convs = [m for m in self.modules() if isinstance(m, CausalConv1d) and m.history > 0]
        self._tconvs = [m for m in self.modules() if isinstance(m, CausalConvTranspose1d) and m.overlap > 0]
        for i, m in enumerate(self._convs):
            m.slot = i
        for i, m in enumerate(self._tconvs):
            m.slot = i
        for i, layer in enumerate(self.pre_transformer.layers):
            layer.self_attn.layer = i

    def new_stream_state(self, batch_size: int = 1, device: torch.device | str | None = None,
                         dtype: torch.dtype | None = None) -> DecoderStreamState:
        """A zeroed state for `batch_size` new streams (position 0). Defaults: the weights' device and dtype."""
        weight = self.pre_conv.conv.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        cfg = self.cfg

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(batch_size, *shape, device=device, dtype=dtype)

        kv = (cfg.num_key_value_heads, cfg.sliding_window - 1, cfg.head_dim)
        return DecoderStreamState(
            position=torch.zeros(batch_size, dtype=torch.long, device=device),
            conv=[zeros(m.conv.in_channels, m.history) for m in self._convs],
            overlap=[zeros(m.conv.out_channels, m.overlap) for m in self._tconvs],
            keys=[zeros(*kv) for _ in range(cfg.num_hidden_layers)],
            values=[zeros(*kv) for _ in range(cfg.num_hidden_layers)],
        )

    @torch.no_grad()
    def decode_chunk(self, codes: Tensor, state: DecoderStreamState) -> Tensor:
        """Decode the next F frames of each stream: codes [B, Q, F] -> waveform [B, F * samples_per_frame].

        Updates `state` in place (positions advance by F). Rows may be at different stream offsets; all rows share
        F. The output is clamped to [-1, 1] and has the weights' dtype.
        """
        b, q, f = codes.shape
        if q != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} codebooks, got codes of shape {tuple(codes.shape)}")
        if b != state.batch_size:
            raise ValueError(f"codes batch {b} != state batch {state.batch_size}")
        if f == 0:
            return codes.new_zeros(b, 0, dtype=self.pre_conv.conv.weight.dtype)

        x = self.quantizer(codes)                             # [B, codebook_dim, F]
        x = self.pre_conv(x, state)                           # [B, latent, F]
        x = self.pre_transformer(x.transpose(1, 2), state)    # [B, F, latent]
        x = x.transpose(1, 2)                                 # [B, latent, F]
        for stage in self.upsample:
            x = stage(x, state)                               # [B, latent, F * prod(upsampling_ratios)]
        for layer in self.decoder:
            x = layer(x) if isinstance(layer, SnakeBeta) else layer(x, state)
        state.position += f
        return x.squeeze(1).clamp(-1.0, 1.0)                  # [B, F * samples_per_frame]

    @torch.no_grad()
    def forward(self, codes: Tensor, chunk_frames: int | None = None) -> Tensor:
        """One-pass decode, positions 0..T-1: codes [B, Q, T] -> waveform [B, T * samples_per_frame] in [-1, 1].

        `chunk_frames` decodes through the streaming path in chunks of that many frames: the same result (exact,
        unlike the reference's 300/25 chunked decode) with activation memory bounded by the chunk size.
        """
        state = self.new_stream_state(codes.shape[0], codes.device)
        if chunk_frames is None or chunk_frames >= codes.shape[-1]:
            return self.decode_chunk(codes, state)
        return torch.cat([self.decode_chunk(c, state) for c in codes.split(chunk_frames, dim=-1)], dim=-1)
