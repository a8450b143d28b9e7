"""Talker (predicts codebook 0 once per 80 ms frame) and code predictor (codebooks 1..15), model doc §4–§5.

Module names follow the checkpoint's `talker.*` keys so weights load by name.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from .checkpoint_config import TalkerConfig
from .layers import DecoderStack, KVCache, causal_mask, rope_cos_sin


class TalkerBackbone(DecoderStack):
    """`talker.model`: codec + text embeddings, Qwen3 layers, final norm."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """text_hidden → text_hidden → talker hidden, SiLU between (both Linears have a bias)."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden)
        self.linear_fc2 = nn.Linear(text_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictorBackbone(DecoderStack):
    def __init__(self, cfg: TalkerConfig) -> None:
        cp = cfg.code_predictor
        super().__init__(cp)
        # embeddings of codebooks 1..15 are talker-width: they are summed into the talker's next input
        self.codec_embedding = nn.ModuleList(nn.Embedding(cp.vocab_size, cfg.hidden_size)
                                             for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        cp = cfg.code_predictor
        self.num_code_groups = cfg.num_code_groups
        self.model = CodePredictorBackbone(cfg)
        self.lm_head = nn.ModuleList(nn.Linear(cp.hidden_size, cp.vocab_size, bias=False)
                                     for _ in range(cfg.num_code_groups - 1))
        self.small_to_mtp_projection = (nn.Linear(cfg.hidden_size, cp.hidden_size)
                                        if cp.hidden_size != cfg.hidden_size else nn.Identity())
        self.projected_embeddings: list[torch.Tensor] | None = None  # fold_embedding_projections()

    @torch.inference_mode()
    def fold_embedding_projections(self) -> None:
        """Each codebook's embedding followed by small_to_mtp_projection, as one table [vocab, cp hidden]: a frame's
        14 projections of one embedding row each become lookups (1.7B, CPU: 104 → 2 µs per codebook at 1 row, 1.4
        → 0.01 ms at 32; docs/benchmarks.md). Only where the widths differ (1.7B; the 0.6B's projection is the
        identity). A table row is the projection of that row computed among all the vocabulary's rows, which can
        differ from the same row projected alone in the last bits; the goldens hold either way (tests)."""
        if isinstance(self.small_to_mtp_projection, nn.Identity):
            return
        # codebooks 1..14 feed the next step; the 15th's embedding is only summed into the talker's next input
        self.projected_embeddings = [self.small_to_mtp_projection(embedding.weight)
                                     for embedding in self.model.codec_embedding[:-1]]

    def predict(self, hidden: torch.Tensor, c0_embed: torch.Tensor, cache: KVCache,
                sample: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """Codebooks 1..15 of one frame for every row, batched.

        hidden: [B, H] talker post-norm hidden that produced c0; c0_embed: [B, H] = C(c0).
        cache: a KVCache of >= num_code_groups slots for B rows (overwritten: the CP starts fresh every frame).
        sample(logits [B, V], j) -> [B] ids for codebook j+1. Returns [B, 15] ids.
        """
        device = hidden.device
        x = self.small_to_mtp_projection(torch.stack((hidden, c0_embed), dim=1))
        # every row sits at the same positions 0..15 over a fresh cache: RoPE and the causal mask are computed
        # once per frame and sliced per codebook, not rebuilt 15 times
        num_slots = self.num_code_groups
        positions = torch.arange(num_slots, device=device)
        cos, sin = rope_cos_sin(positions[None], self.model.cfg.head_dim, self.model.cfg.rope_theta, x.dtype)
        causal = (positions[None, :] <= positions[:, None])[None, None]                     # [1, 1, S, S]
        codes = []
        start = 0
        for j in range(self.num_code_groups - 1):
            end = start + x.shape[1]
            h = self.model.run_layers(x, None, cache, start, causal[:, :, start:end, :end],
                                      rope=(cos[:, :, start:end], sin[:, :, start:end]))
            ids = sample(self.lm_head[j](h[:, -1]), j)
            codes.append(ids)
            start = end
            if j + 1 < self.num_code_groups - 1:
                if self.projected_embeddings is not None:
                    x = self.projected_embeddings[j][ids][:, None]
                else:
                    x = self.small_to_mtp_projection(self.model.codec_embedding[j](ids))[:, None]
        return torch.stack(codes, dim=1)

    def embed_rest(self, codes_rest: torch.Tensor) -> torch.Tensor:
        """Σ_j E_j(c_{j+1}) in talker width. codes_rest: [..., 15] → [..., H]."""
        total = self.model.codec_embedding[0](codes_rest[..., 0])
        for j in range(1, self.num_code_groups - 1):
            total = total + self.model.codec_embedding[j](codes_rest[..., j])
        return total


class Talker(nn.Module):
    """`talker.*`: backbone, text projection, codec head, code predictor."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TalkerBackbone(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """T(id): text_projection(text_embedding(id)). ids: [...] → [..., H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """C(id). ids: [...] → [..., H]."""
        return self.model.codec_embedding(ids)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Σ16 of whole frames: C(c0) + Σ_j E_j(c_{j+1}). codes: [..., 16] → [..., H]."""
        return self.embed_codec(codes[..., 0]) + self.code_predictor.embed_rest(codes[..., 1:])

    def prefill(self, inputs_embeds: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
                key_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompts at positions 0..lengths[b]-1 of their cache rows. inputs_embeds: [B, L, H];
        key_valid: [B, L]. Returns (post-norm hidden at each row's last prompt position [B, H], logits)."""
        b, length = key_valid.shape
        positions = torch.arange(length, device=lengths.device).expand(b, length)
        hidden = self.model.run_layers(inputs_embeds, positions, cache, 0, causal_mask(key_valid, 0, length))
        last = hidden[torch.arange(b, device=lengths.device), lengths - 1]
        return last, self.codec_head(last)

    def decode_step(self, inputs_embeds: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                    num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at its own slot (= its RoPE position; rows hold unpadded sequences).
        inputs_embeds: [B, H]; slots: [B]; attends over slots 0..slots[b] within the first num_slots."""
        key_valid = torch.arange(num_slots, device=slots.device)[None, :] <= slots[:, None]
        hidden = self.model.run_layers(inputs_embeds[:, None], slots[:, None], cache, slots,
                                       key_valid[:, None, None, :])[:, -1]
        return hidden, self.codec_head(hidden)
