"""Talker (predicts codebook 0 once per 80 ms frame) and code predictor (codebooks 1..15), model doc §4–§5.

Module names follow the checkpoint's `talker.*` keys so weights load by name.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
import torch.nn.functional as F

from .checkpoint_config import TalkerConfig
from .layers import DecoderStack, KVCache, causal_mask, embedding, rope_cos_sin

if TYPE_CHECKING:
    from types import ModuleType

    from .lora_slots import StackLoRA

logger = logging.getLogger(__name__)


TEXT_TABLE_BLOCK = 4096  # rows projected per call while the text table is made: bounds its transient memory


def import_fused_kernels(dtype: torch.dtype) -> "ModuleType | None":
    """fused_kernels.py when Triton imports and the kernels take `dtype` (fp32, bf16); else None, said in the log."""
    try:
        kernels = importlib.import_module(f"{__package__}.fused_kernels")
    except ImportError as e:   # a CUDA build of torch ships Triton; another may not
        logger.warning("fused kernels off: %s (the plain ops run)", e)
        return None
    if not kernels.supports(dtype):
        logger.warning("fused kernels off: they take %s, not %s (the plain ops run)", kernels.DTYPES, dtype)
        return None
    return kernels


class TalkerBackbone(DecoderStack):
    """`talker.model`: codec + text embeddings, Qwen3 layers, final norm."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg)
        self.codec_embedding = embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = embedding(cfg.text_vocab_size, cfg.text_hidden_size)


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
        self.codec_embedding = nn.ModuleList(embedding(cp.vocab_size, cfg.hidden_size)
                                             for _ in range(cfg.num_code_groups - 1))


@dataclass(frozen=True)
class FramePositions:
    """The code predictor's RoPE (cos, sin: [1, 1, S, D]) and causal mask ([1, 1, S, S]) over its S slots."""
    cos: torch.Tensor
    sin: torch.Tensor
    causal: torch.Tensor


class CodePredictor(nn.Module):
    """Codebooks 1..15 of a frame, one `decode_step` each over a fresh cache; the caller draws each codebook's id
    and feeds it back (`embed_codebook`)."""

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
        14 projections of one embedding row each become lookups (docs/benchmarks.md, "Per-codebook embedding tables").
        Only where the widths differ (1.7B; the 0.6B's projection is the identity). A table row is the projection of
        that row computed among all the vocabulary's rows, which can differ from the same row projected alone in the
        last bits; the goldens hold either way (tests)."""
        if isinstance(self.small_to_mtp_projection, nn.Identity):
            return
        # codebooks 1..14 feed the next step; the 15th's embedding is only summed into the talker's next input
        self.projected_embeddings = [self.small_to_mtp_projection(embedding.weight)
                                     for embedding in self.model.codec_embedding[:-1]]

    def frame_positions(self, device: torch.device | str, dtype: torch.dtype) -> FramePositions:
        """RoPE and causal mask of positions 0..num_code_groups-1: every row of every frame sits at them over a
        fresh cache, so they are made once, not per frame."""
        positions = torch.arange(self.num_code_groups, device=device)
        cos, sin = rope_cos_sin(positions[None], self.model.cfg.head_dim, self.model.cfg.rope_theta, dtype)
        return FramePositions(cos, sin, (positions[None, :] <= positions[:, None])[None, None])

    def frame_inputs(self, hidden: torch.Tensor, c0_embed: torch.Tensor) -> torch.Tensor:
        """The first step's inputs: hidden [B, H] (the talker's post-norm hidden that produced c0) and
        c0_embed [B, H] = C(c0) → [B, 2, cp hidden]."""
        return self.small_to_mtp_projection(torch.stack((hidden, c0_embed), dim=1))

    def decode_step(self, x: torch.Tensor, codebook: int, cache: KVCache, positions: FramePositions,
                    lora: "StackLoRA | None" = None) -> torch.Tensor:
        """Codebook `codebook`'s (1..15) logits [B, V] for every row. x: [B, L, cp hidden] the inputs not yet run,
        at slots codebook+1-L..codebook: `frame_inputs` (L = 2) for codebook 1, then the previous codebook's
        `embed_codebook` (L = 1). cache: >= num_code_groups slots for B rows, overwritten each frame. lora: the
        rows' adapters (lora_slots.py), None without LoRA rows."""
        end = codebook + 1
        start = end - x.shape[1]
        h = self.model.run_layers(x, None, cache, start, positions.causal[:, :, start:end, :end],
                                  rope=(positions.cos[:, :, start:end], positions.sin[:, :, start:end]), lora=lora)
        return self.lm_head[codebook - 1](h[:, -1])

    def embed_codebook(self, ids: torch.Tensor, codebook: int) -> torch.Tensor:
        """Codebook `codebook`'s ids [B] (1..14) as the next step's input [B, 1, cp hidden]."""
        if self.projected_embeddings is not None:
            return self.projected_embeddings[codebook - 1][ids][:, None]
        return self.small_to_mtp_projection(self.model.codec_embedding[codebook - 1](ids))[:, None]

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
        self.text_table: torch.Tensor | None = None
        self.kernels: ModuleType | None = None   # use_fused_kernels: the step's draws take them too

    def use_fused_kernels(self, kernels: "ModuleType | None") -> None:
        """The talker's and the code predictor's layers, and the step's draws, on `kernels` (import_fused_kernels),
        or the plain ops."""
        self.kernels = kernels
        self.model.use_fused_kernels(kernels)
        self.code_predictor.model.use_fused_kernels(kernels)

    @torch.inference_mode()
    def fold_text_projection(self) -> None:
        """T(id) = text_projection(text_embedding(id)) for every id, as one table [text vocab, H] that replaces both:
        a prompt's text rows are one lookup instead of a projection per token (which a row projected alone needs,
        to be the same bits however a text is cut), and streamed text is embedded as the whole text is. The table is
        made in blocks of TEXT_TABLE_BLOCK rows (the same blocks on every start: the same bits); a row can differ
        from the same row projected among a prompt's in the last bits; the goldens hold either way (tests). Costs
        the start one pass over the vocabulary (a GPU: milliseconds; the 0.6B's on 2 CPU cores: ~18 s)."""
        weight = self.model.text_embedding.weight
        self.text_table = torch.cat([self.text_projection(weight[i:i + TEXT_TABLE_BLOCK])
                                     for i in range(0, weight.shape[0], TEXT_TABLE_BLOCK)])
        del self.model.text_embedding, self.text_projection

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """T(id): a row of the folded table (fold_text_projection), else projected. ids: [...] → [..., H]."""
        if self.text_table is not None:
            return self.text_table[ids]
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """C(id). ids: [...] → [..., H]."""
        return self.model.codec_embedding(ids)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Σ16 of whole frames: C(c0) + Σ_j E_j(c_{j+1}). codes: [..., 16] → [..., H]."""
        return self.embed_codec(codes[..., 0]) + self.code_predictor.embed_rest(codes[..., 1:])

    def prefill(self, inputs_embeds: torch.Tensor, lengths: torch.Tensor, cache: KVCache, key_valid: torch.Tensor,
                lora: "StackLoRA | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompts at positions 0..lengths[b]-1 of their cache rows. inputs_embeds: [B, L, H];
        key_valid: [B, L]; lora: the rows' adapters. Returns (post-norm hidden at each row's last prompt position
        [B, H], logits)."""
        b, length = key_valid.shape
        positions = torch.arange(length, device=lengths.device).expand(b, length)
        hidden = self.model.run_layers(inputs_embeds, positions, cache, 0, causal_mask(key_valid, 0, length),
                                       lora=lora)
        last = hidden[torch.arange(b, device=lengths.device), lengths - 1]
        return last, self.codec_head(last)

    def decode_step(self, inputs_embeds: torch.Tensor, slots: torch.Tensor, cache: KVCache, num_slots: int,
                    lora: "StackLoRA | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at its own slot (= its RoPE position; rows hold unpadded sequences).
        inputs_embeds: [B, H]; slots: [B]; attends over slots 0..slots[b] within the first num_slots; lora: the
        rows' adapters."""
        key_valid = torch.arange(num_slots, device=slots.device)[None, :] <= slots[:, None]
        hidden = self.model.run_layers(inputs_embeds[:, None], slots[:, None], cache, slots,
                                       key_valid[:, None, None, :], lora=lora)[:, -1]
        return hidden, self.codec_head(hidden)
