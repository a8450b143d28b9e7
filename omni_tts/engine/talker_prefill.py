"""The talker's prefill at static shapes: what a CUDA graph replays, so an admission costs one replay per group of
prompts (on an H200 an eager prefill is launch-bound: ~1,800 kernels, 33 ms for 4.6 ms of kernel time), not a
stall of every running stream.

An admission's prompts are grouped (`prefill_groups`): at most MAX_PREFILL_BATCH prompts, padded to a length
bucket (`prefill_length_buckets`: every length from MIN_PROMPT_ROWS to EXACT_PREFILL_MAX exact, which holds the
streaming layouts' 8-10 rows, then ~1.5x steps up to the largest prompt a step prefills) within `capacity` tokens.
A group's batch size is exact (1..MAX_PREFILL_BATCH), so no row of a group is padding. The group's inputs are
copied into static buffers (embeds, lengths, destination rows); its forward runs on a static staging KV cache
(slots 0..L-1 of b rows, a view of one flat buffer of `capacity` tokens), and the staged keys and values, the
last hidden states and the logits are scattered into the runner's rows through the destination-row index
(`index_copy_`): one graph serves any rows (a view `cache.rows(first_row, ...)` would bake them in). Token padding
writes only beyond each prompt's length in its own row, which no mask reaches before decode overwrites it. A
prompt longer than the largest bucket is not grouped: the runner prefills it eagerly (dynamic shapes).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from omni_tts.models.qwen3_tts.checkpoint_config import TalkerConfig
from omni_tts.models.qwen3_tts.device_copy import to_device
from omni_tts.models.qwen3_tts.layers import KVCache
from omni_tts.models.qwen3_tts.lora_slots import LoRASlots
from omni_tts.models.qwen3_tts.prompt import MIN_PROMPT_ROWS
from omni_tts.models.qwen3_tts.talker import Talker

from .buckets import bucket
from .cuda_graphs import capture

# Prompts prefilled by one replay. More graphs per length bucket for each step up; an admission of more (a burst)
# replays one graph per group. Eight 16-row prompts (128 tokens) are still launch-bound on a GPU.
MAX_PREFILL_BATCH = 8
EXACT_PREFILL_MAX = 16   # lengths up to here are captured exactly: the short prompts that occur pad nothing


def prefill_length_buckets(max_len: int) -> list[int]:
    """MIN_PROMPT_ROWS..EXACT_PREFILL_MAX, then 24, 32, 48, 64, 96, ... (powers of two and 1.5x between), the last
    max_len (the longest prompt a group may hold). Shorter prompts (not made by embed_prompt) take the first."""
    sizes, size = list(range(MIN_PROMPT_ROWS, EXACT_PREFILL_MAX + 1)), EXACT_PREFILL_MAX
    while size < max_len:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
        sizes.append(size)
    return [s for s in sizes if s < max_len] + [max_len]


def prefill_groups(lengths: list[int], buckets: list[int], capacity: int) -> tuple[list[tuple[int, list[int]]],
                                                                                     list[int]]:
    """The prompts of lengths `lengths` (by index) as graph groups (bucket length L, indices), longest first: at most
    MAX_PREFILL_BATCH prompts of at least L/2 rows (padding at most doubles a group's tokens), b*L <= capacity;
    and the indices too long for any bucket (prefilled eagerly)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    eager = [i for i in order if lengths[i] > buckets[-1]]
    groups: list[tuple[int, list[int]]] = []
    for i in order[len(eager):]:
        if groups:
            length, members = groups[-1]
            if (len(members) < MAX_PREFILL_BATCH and (len(members) + 1) * length <= capacity
                    and 2 * lengths[i] >= length):
                members.append(i)
                continue
        groups.append((bucket(buckets, lengths[i]), [i]))
    return groups, eager


class StaticPrefill:
    """The static buffers of the prefill's graphs: inputs (embeds, lengths, destination rows), the staging KV cache;
    it writes into the runner's `cache`, `hidden` and `logits` rows. `max_len`: the longest bucket; `capacity`:
    the tokens one group may hold."""

    def __init__(self, talker: Talker, cfg: TalkerConfig, max_len: int, capacity: int, cache: KVCache,
                 hidden: torch.Tensor, logits: torch.Tensor, adapter_slots: torch.Tensor,
                 lora: LoRASlots | None) -> None:
        self.talker, self.cache, self.hidden, self.logits = talker, cache, hidden, logits
        self.adapter_slots, self.lora = adapter_slots, lora
        self.length_buckets = prefill_length_buckets(max_len)
        # a group never holds more than MAX_PREFILL_BATCH of the longest; eight short prompts always fit one
        self.capacity = max(min(capacity, MAX_PREFILL_BATCH * max_len),
                            MAX_PREFILL_BATCH * min(max_len, EXACT_PREFILL_MAX))
        device, dtype = hidden.device, hidden.dtype
        self.embeds = torch.zeros(self.capacity, cfg.hidden_size, device=device, dtype=dtype)   # [b*L, H] flat
        self.lengths = torch.ones(MAX_PREFILL_BATCH, dtype=torch.long, device=device)
        self.rows = torch.zeros(MAX_PREFILL_BATCH, dtype=torch.long, device=device)   # each prompt's runner row
        shape = (cfg.num_hidden_layers, self.capacity * cfg.num_key_value_heads * cfg.head_dim)
        self.staging_k = torch.zeros(shape, device=device, dtype=dtype)
        self.staging_v = torch.zeros(shape, device=device, dtype=dtype)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}   # (prompts, length, lora)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (prompts, bucket length) a group can have: what start-up captures, most tokens first."""
        return sorted(((b, length) for length in self.length_buckets for b in range(1, MAX_PREFILL_BATCH + 1)
                       if b * length <= self.capacity), key=lambda s: -s[0] * s[1])

    def prefill(self, prompts: list[torch.Tensor], rows: list[int], length: int, lora: bool) -> None:
        """One group: prompts [L_i, H] on the device (L_i <= length, a bucket) into runner rows `rows`, by its
        graph where one was captured, else eagerly at the same shapes. lora: whether a row has an adapter."""
        b = len(prompts)
        embeds = self.embeds[:b * length].view(b, length, -1)
        for i, prompt in enumerate(prompts):   # padding keeps earlier prompts' (finite) rows: no mask reaches them
            embeds[i, :prompt.shape[0]] = prompt
        meta = to_device(torch.tensor([[p.shape[0] for p in prompts], rows]), self.rows.device)   # one copy
        self.lengths[:b], self.rows[:b] = meta[0], meta[1]
        graph = self.graphs.get((b, length, lora))
        if graph is not None:
            graph.replay()
        else:
            self.run(b, length, lora)

    def run(self, b: int, length: int, lora: bool) -> None:
        """The forward of a loaded group of b prompts padded to `length`, shape-static: what a CUDA graph captures.
        lora: whether it adds the rows' adapters."""
        embeds = self.embeds[:b * length].view(b, length, -1)
        lengths, rows = self.lengths[:b], self.rows[:b]
        key_valid = torch.arange(length, device=rows.device)[None] < lengths[:, None]
        staging = self._staging(b, length)
        adapters = self.lora.forward_rows(self.adapter_slots[rows])[0] if lora else None
        hidden, logits = self.talker.prefill(embeds, lengths, staging, key_valid, adapters)
        # [layers, rows, kv heads, slots, D]: the group's L slots into its rows
        self.cache.k[:, :, :, :length].index_copy_(1, rows, staging.k)
        self.cache.v[:, :, :, :length].index_copy_(1, rows, staging.v)
        self.hidden.index_copy_(0, rows, hidden)
        self.logits.index_copy_(0, rows, logits)

    def capture_graphs(self, lora_kinds: tuple[bool, ...], pool: Any = None) -> Any:
        """A graph of every group shape and LoRA kind, most tokens first (the smaller reuse its memory); returns the
        memory pool for the decode graphs (a prefill's outputs are the runner's buffers: nothing of it is read
        from the pool after its replay). The captured runs write row 0 only (free at start-up)."""
        for (b, length), lora in itertools.product(self.shapes(), lora_kinds):
            graph, _ = capture(lambda: self.run(b, length, lora), self.rows.device, pool)
            pool = graph.pool()
            self.graphs[(b, length, lora)] = graph
        return pool

    def _staging(self, b: int, length: int) -> KVCache:
        """A KVCache of b rows and `length` slots, a view of the flat staging buffers (the same addresses for every
        call of a shape)."""
        layers, heads, dim = self.cache.k.shape[0], self.cache.k.shape[2], self.cache.k.shape[4]
        view = KVCache.__new__(KVCache)
        view.k, view.v = (s[:, :b * heads * length * dim].view(layers, b, heads, length, dim)
                          for s in (self.staging_k, self.staging_v))
        return view
