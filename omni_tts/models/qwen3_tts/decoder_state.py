"""The streaming state of the speech decoder: exactly the past each causal layer still needs.

What each layer keeps between chunks:
  - causal conv (kernel k, dilation d): its last (k-1)*d input samples (zeros before the stream starts, which is
    exactly the left zero padding of a one-pass decode);
  - causal transposed conv (kernel k, stride s): the k-s output samples that the next input still overlap-adds
    into, kept WITHOUT bias (the bias is added once, when a sample is emitted);
  - attention layer: the last `sliding_window - 1` rotated keys / values (the window includes the current frame),
    right-aligned in a fixed-size buffer; slots before the start of the stream are masked out;
  - `position`: frames already decoded per request, i.e. the absolute RoPE position of the next frame.
All state tensors are batch-first and fixed-size, and are updated in place, so one state can hold many streams (a
pool of slots) and streams at different offsets can be gathered into one batch and scattered back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StateLayout:
    """A decoder's per-stream float state, as shapes of one row: its conv histories, transposed-conv overlaps, and
    each attention layer's keys and values ([kv_heads, W-1, head_dim]). A state of this layout keeps them all as
    views of one `arena` [B, total] (and `position` apart, int64), so moving streams between a pool and a batch is
    one index_select / index_copy_ of the arena and one of the positions: 4 kernels a decoder call, where a copy per
    state tensor took two for each of dozens (the leaders gather and scatter a stream's codec state as one piece)."""
    conv: tuple[tuple[int, ...], ...]
    overlap: tuple[tuple[int, ...], ...]
    kv: tuple[int, int, int]
    num_layers: int

    def shapes(self) -> list[tuple[int, ...]]:
        return [*self.conv, *self.overlap, *[self.kv] * (2 * self.num_layers)]

    def zeros(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> "DecoderStreamState":
        total = sum(math.prod(shape) for shape in self.shapes())
        return self.state(torch.zeros(batch_size, dtype=torch.long, device=device),
                          torch.zeros(batch_size, total, device=device, dtype=dtype))

    def state(self, position: Tensor, arena: Tensor) -> "DecoderStreamState":
        """The state whose tensors are views of `arena`'s columns, in this layout."""
        views, start = [], 0
        for shape in self.shapes():
            size = math.prod(shape)
            views.append(arena[:, start:start + size].view(arena.shape[0], *shape))
            start += size
        conv, overlap = len(self.conv), len(self.conv) + len(self.overlap)
        keys = views[overlap:overlap + self.num_layers]
        return DecoderStreamState(position, views[:conv], views[conv:overlap], keys,
                                  views[overlap + self.num_layers:], arena, self)


@dataclass
class DecoderStreamState:
    """Per-request streaming state of a `SpeechDecoder`; every tensor has the batch on dim 0.

    `SpeechDecoder.decode_chunk` updates the tensors in place (buffers never change shape or address). Made by a
    `StateLayout`: conv, overlap, keys and values are views of `arena`.
    """
    position: Tensor       # [B] int64: frames decoded so far = absolute position of the next frame
    conv: list[Tensor]     # per causal conv with k > 1: [B, C_in, (k-1)*d] last input samples
    overlap: list[Tensor]  # per transposed conv with k > s: [B, C_out, k-s] pending output samples, no bias
    keys: list[Tensor]     # per attention layer: [B, kv_heads, W-1, head_dim] rotated keys, oldest first
    values: list[Tensor]   # per attention layer: [B, kv_heads, W-1, head_dim]
    arena: Tensor          # [B, total]: the float state's memory, every tensor above but position a view of it
    layout: StateLayout

    @property
    def batch_size(self) -> int:
        return self.position.shape[0]

    def rows(self, start: int, end: int) -> "DecoderStreamState":
        """Rows start..end-1 as views: decoding on them updates this state in place."""
        return self.layout.state(self.position[start:end], self.arena[start:end])

    def zero_rows(self, start: int, end: int) -> None:
        """Rows start..end-1 back to a new stream's state (position 0)."""
        self.position[start:end] = 0
        self.arena[start:end] = 0

    def gather(self, index: Tensor) -> "DecoderStreamState":
        """The rows at `index` ([n] int64 on the state's device), copied into a new batch."""
        return self.layout.state(self.position.index_select(0, index), self.arena.index_select(0, index))

    def gather_into(self, index: Tensor, batch: "DecoderStreamState") -> None:
        """The rows at `index` copied into `batch` (a state of index's length: fixed buffers stay in place)."""
        torch.index_select(self.position, 0, index, out=batch.position)
        torch.index_select(self.arena, 0, index, out=batch.arena)

    def scatter(self, index: Tensor, batch: "DecoderStreamState") -> None:
        """Write `batch`'s rows back to this state's rows at `index` (what `gather` took, advanced)."""
        self.position.index_copy_(0, index, batch.position)
        self.arena.index_copy_(0, index, batch.arena)
