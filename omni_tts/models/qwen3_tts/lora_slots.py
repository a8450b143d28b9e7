"""Several LoRA adapters in one batched forward: static per-slot buffers and the rows' slot masks.

Every target linear (lora.py) gets buffers holding all `max_loras` adapters side by side, ranks padded to
`max_rank` with zeros and the scale folded into B: A [W, in] and B [out, W] (W = max_loras * max_rank; adapter
slot s, 1..max_loras, holds rows / columns (s-1)*R .. s*R-1 of them; slot 0 is no adapter). A row's mask [W] is 1
on its slot's block, 0 elsewhere (all 0 for slot 0), so one forward computes for every row

    x W^T + ((x A^T) * mask) B^T = x W^T + (x A_slot^T) B_slot^T

with plain matmuls: no per-row weight gather, and every adapter's weights read once per call whatever the batch
(a gather + bmm reads batch * R * in per linear). Other slots' terms are exact zeros, so a row without an adapter
gets the plain linear's values. The linears that read one input share one A matmul (q, k, v; gate, up: their A
buffers are stacked), and B's product is added by one addmm per linear: 15 ops per layer instead of 28, which
counts in a launch-bound step. Loading an adapter copies into its block (`copy_`): the buffers never move, so a
captured CUDA graph stays valid.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checkpoint_config import TalkerConfig
from .lora import STACKS, LoRAAdapter, target_linears

# the linears of a layer that read one input, in the order the layer passes their outputs
GROUPS = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o": ("self_attn.o_proj",),
          "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down": ("mlp.down_proj",)}


class LayerLoRA:
    """One layer's adapters in one forward: per group its stacked A [n*W, in] and each linear's B [out, W], and the
    rows' masks, tiled n times ([B, 1, n*W])."""

    def __init__(self, groups: dict[str, tuple[torch.Tensor, list[torch.Tensor]]],
                 masks: dict[int, torch.Tensor]) -> None:
        self.groups, self.masks = groups, masks

    def add(self, group: str, x: torch.Tensor, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The group's linears' outputs x W^T ([B, L, out] each) plus each row's adapter. x: [B, L, in]."""
        a, bs = self.groups[group]
        t = (F.linear(x, a) * self.masks[len(bs)]).flatten(0, 1)   # [B*L, n*W]
        width = a.shape[0] // len(bs)
        return tuple(torch.addmm(y.flatten(0, 1), t[:, i * width:(i + 1) * width], b.t()).view_as(y)
                     for i, (y, b) in enumerate(zip(outputs, bs)))


class StackLoRA:
    """A decoder stack's adapters in one forward: each layer's `LayerLoRA`."""

    def __init__(self, layers: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]],
                 masks: dict[int, torch.Tensor]) -> None:
        self.layers, self.masks = layers, masks

    def layer(self, i: int) -> LayerLoRA:
        return LayerLoRA(self.layers[i], self.masks)


class LoRASlots:
    """The static buffers of up to `max_loras` adapters for every target linear of the talker and the code
    predictor, and the slot masks. Owned by the talker's runner, like its KV cache."""

    def __init__(self, config: TalkerConfig, max_loras: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        assert max_loras >= 1 and max_rank >= 1
        self.max_loras, self.max_rank = max_loras, max_rank
        width = max_loras * max_rank
        linears = target_linears(config)
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # module path → (its A rows, its B)
        self.stack_layers = []
        for stack, cfg in zip(STACKS, (config, config.code_predictor)):
            layers = []
            for i in range(cfg.num_hidden_layers):
                groups = {}
                for group, names in GROUPS.items():
                    paths = [f"{stack}.layers.{i}.{name}" for name in names]
                    a = torch.zeros(len(names) * width, linears[paths[0]][0], device=device, dtype=dtype)
                    bs = [torch.zeros(linears[p][1], width, device=device, dtype=dtype) for p in paths]
                    for j, (path, b) in enumerate(zip(paths, bs)):
                        self.buffers[path] = (a[j * width:(j + 1) * width], b)
                    groups[group] = (a, bs)
                layers.append(groups)
            self.stack_layers.append(layers)
        # masks[n][s]: [n*W], ones on slot s's block of each of n stacked groups; row 0 (no adapter) all zeros
        single = torch.zeros(max_loras + 1, width, device=device, dtype=dtype)
        for slot in range(1, max_loras + 1):
            single[slot, (slot - 1) * max_rank:slot * max_rank] = 1
        self.masks = {n: single.repeat(1, n) for n in sorted({len(names) for names in GROUPS.values()})}

    def forward_rows(self, slots: torch.Tensor) -> tuple[StackLoRA, StackLoRA]:
        """The talker's and the code predictor's adapters for rows with adapter slots `slots` [B] (long)."""
        masks = {n: table[slots][:, None] for n, table in self.masks.items()}   # [B, 1, n*W]
        return StackLoRA(self.stack_layers[0], masks), StackLoRA(self.stack_layers[1], masks)

    @torch.inference_mode()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into slot `slot` (1..max_loras), zeros wherever it has no weights."""
        assert 1 <= slot <= self.max_loras and adapter.rank <= self.max_rank
        self.clear(slot)
        block = slice((slot - 1) * self.max_rank, (slot - 1) * self.max_rank + adapter.rank)
        for module, (a, b) in adapter.weights.items():
            a_all, b_all = self.buffers[module]
            a_all[block].copy_(a)
            b_all[:, block].copy_(b)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        block = slice((slot - 1) * self.max_rank, slot * self.max_rank)
        for a_all, b_all in self.buffers.values():
            a_all[block].zero_()
            b_all[:, block].zero_()
