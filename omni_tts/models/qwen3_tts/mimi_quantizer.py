"""The speech encoder's split residual vector quantizer, encode side: latents → codes by nearest centroid."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mimi_config import MimiEncoderConfig


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
