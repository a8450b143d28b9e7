"""Several LoRA adapters in one batched forward: static per-slot buffers and the rows' slot masks.

Every target linear (lora.py) gets two buffers holding all `max_loras` adapters side by side, ranks padded to
`max_rank` with zeros and the scale folded into B: A [S*R, in] and B [out, S*R] (S = max_loras, R = max_rank;
adapter slot s, 1..S, holds rows / columns (s-1)*R .. s*R-1; slot 0 is no adapter). A row's mask [S*R] is 1 on its
slot's block, 0 elsewhere (all 0 for slot 0), so one forward computes for every row

    x W^T + ((x A^T) * mask) B^T = x W^T + (x A_slot^T) B_slot^T

with two plain matmuls per linear: no per-row weight gather, and every adapter's weights read once per call
whatever the batch (a gather + bmm reads B*R*in per linear). Other slots' terms are exact zeros, so a row without
an adapter gets the plain linear's values. Loading an adapter copies into its block (`copy_`): the buffers never
move, so a captured CUDA graph stays valid.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checkpoint_config import TalkerConfig
from .lora import STACKS, LoRAAdapter, target_linears


class LayerLoRA:
    """One layer's adapters in one forward: its target linears' (A, B) buffers and the rows' masks [B, 1, S*R]."""

    def __init__(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        self.weights, self.mask = weights, mask

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = x W^T of linear `name` (`self_attn.q_proj`, ...) plus each row's adapter. x: [B, L, in]."""
        a, b = self.weights[name]
        return y + F.linear(F.linear(x, a) * self.mask, b)


class StackLoRA:
    """A decoder stack's adapters in one forward: each layer's `LayerLoRA`."""

    def __init__(self, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], mask: torch.Tensor) -> None:
        self.layers, self.mask = layers, mask

    def layer(self, i: int) -> LayerLoRA:
        return LayerLoRA(self.layers[i], self.mask)


class LoRASlots:
    """The static buffers of up to `max_loras` adapters for every target linear of the talker and the code
    predictor, and the slot masks. Owned by the talker's runner, like its KV cache."""

    def __init__(self, config: TalkerConfig, max_loras: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        assert max_loras >= 1 and max_rank >= 1
        self.max_loras, self.max_rank = max_loras, max_rank
        width = max_loras * max_rank
        self.buffers = {module: (torch.zeros(width, fan_in, device=device, dtype=dtype),
                                 torch.zeros(fan_out, width, device=device, dtype=dtype))
                        for module, (fan_in, fan_out) in target_linears(config).items()}
        # masks[s]: [S*R], ones on slot s's block; masks[0] (no adapter) all zeros
        self.masks = torch.zeros(max_loras + 1, width, device=device, dtype=dtype)
        for slot in range(1, max_loras + 1):
            self.masks[slot, (slot - 1) * max_rank:slot * max_rank] = 1
        self.stack_layers = [self._layers(stack, cfg.num_hidden_layers)
                             for stack, cfg in zip(STACKS, (config, config.code_predictor))]

    def _layers(self, stack: str, num_layers: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(num_layers)]
        for module, pair in self.buffers.items():
            head, _, name = module.partition(".layers.")
            if head == stack:
                index, _, linear = name.partition(".")
                layers[int(index)][linear] = pair
        return layers

    def forward_rows(self, slots: torch.Tensor) -> tuple[StackLoRA, StackLoRA]:
        """The talker's and the code predictor's adapters for rows with adapter slots `slots` [B] (long)."""
        mask = self.masks[slots][:, None]   # [B, 1, S*R]
        return StackLoRA(self.stack_layers[0], mask), StackLoRA(self.stack_layers[1], mask)

    @torch.inference_mode()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into slot `slot` (1..max_loras), zeros wherever it has no weights."""
        assert 1 <= slot <= self.max_loras and adapter.rank <= self.max_rank
        block = slice((slot - 1) * self.max_rank, slot * self.max_rank)
        for module, (a_all, b_all) in self.buffers.items():
            a_all[block].zero_()
            b_all[:, block].zero_()
            if module in adapter.weights:
                a, b = adapter.weights[module]
                a_all[block][:adapter.rank].copy_(a)
                b_all[:, block][:, :adapter.rank].copy_(b)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        block = slice((slot - 1) * self.max_rank, slot * self.max_rank)
        for a_all, b_all in self.buffers.values():
            a_all[block].zero_()
            b_all[:, block].zero_()
