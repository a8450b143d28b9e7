"""The speech decoder's residual vector quantizer, decode side: codes → the sum of their codebook vectors."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint_config import SpeechDecoderConfig


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
