"""The speech decoder's convolutional blocks, all streaming-aware: `state` is the whole `DecoderStreamState`, and a
layer's `slot` (assigned by `SpeechDecoder`) picks its entry."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .decoder_state import DecoderStreamState

# Three formulations here exist for the CPU only, each measured faster there (`docs/benchmarks.md`): the waveform
# conv as shifted GEMMs, numpy's SIMD sin in SnakeBeta, channels-last residual units. A GPU runs the plain ops (cuDNN
# and fused elementwise kernels have no such slow paths, and the plain ops are what a CUDA graph captures). Tests set
# this False to run the GPU's formulation on the CPU and check the two agree.
CPU_KERNELS = True


def cpu_kernels(x: Tensor) -> bool:
    """Whether the CPU-only formulations apply to x."""
    return CPU_KERNELS and x.device.type == "cpu"


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
        if conv.out_channels == 1 and cpu_kernels(x):
            return self._to_one_channel(x)
        return conv(x)

    def _to_one_channel(self, x: Tensor) -> Tensor:
        """The waveform conv (C_in -> 1) as k shifted [1, C_in] x [C_in, n] products: on a CPU oneDNN's kernel for
        one output channel is slow (`docs/benchmarks.md`, channels-last residual units)."""
        conv, n = self.conv, x.shape[-1] - self.history
        weight, dilation = conv.weight.expand(x.shape[0], -1, -1, -1), conv.dilation[0]  # [B, 1, C_in, k]
        out = torch.baddbmm(conv.bias.view(1, 1, 1), weight[..., 0], x[..., :n])        # [B, 1, n]
        for j in range(1, conv.kernel_size[0]):
            out.baddbmm_(weight[..., j], x[..., j * dilation:j * dilation + n])
        return out


# CausalConvTranspose1d runs as a GEMM up to this many input samples (batch × length): the short calls (a first
# packet's few frames) are where PyTorch's CPU kernel is slow; larger inputs gain nothing over it
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
        (on a CPU PyTorch's own transposed conv takes a slow path there, mostly weight reads)."""
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
        if cpu_kernels(y) and y.dtype == torch.float32:
            # numpy's float32 sin is SIMD, torch's CPU sin is not, and this sin is a sizeable share of a decoder
            # call (`docs/benchmarks.md`); the two differ by at most one unit in the last place
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
# layout for few channels over many samples; wider units gain nothing (`docs/benchmarks.md`)
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
        channels_last = self.channels_last and cpu_kernels(x)
        if channels_last:
            x = x[:, :, None].contiguous(memory_format=torch.channels_last)
        for unit in self.block[2:]:
            x = unit(x, state)
        return x[:, :, 0].contiguous() if channels_last else x
