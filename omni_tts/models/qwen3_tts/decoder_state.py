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

from dataclasses import dataclass

import torch
from torch import Tensor


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

    def tensors(self) -> list[Tensor]:
        """Every state tensor, in a fixed order (the same for states of one decoder)."""
        return [self.position, *self.conv, *self.overlap, *self.keys, *self.values]

    def _from_tensors(self, tensors: list[Tensor]) -> "DecoderStreamState":
        """A state of the same layout as `self` holding `tensors` (in `tensors()` order)."""
        it = iter(tensors)
        position = next(it)
        conv = [next(it) for _ in self.conv]
        overlap = [next(it) for _ in self.overlap]
        keys = [next(it) for _ in self.keys]
        values = [next(it) for _ in self.values]
        return DecoderStreamState(position, conv, overlap, keys, values)

    def rows(self, start: int, end: int) -> "DecoderStreamState":
        """Rows start..end-1 as views: decoding on them updates this state in place."""
        return self._from_tensors([t[start:end] for t in self.tensors()])

    def gather(self, index: Tensor) -> "DecoderStreamState":
        """The rows at `index` ([n] int64 on the state's device), copied into a new batch."""
        return self._from_tensors([t.index_select(0, index) for t in self.tensors()])

    def gather_into(self, index: Tensor, batch: "DecoderStreamState") -> None:
        """The rows at `index` copied into `batch` (a state of index's length: fixed buffers stay in place)."""
        for mine, theirs in zip(self.tensors(), batch.tensors()):
            torch.index_select(mine, 0, index, out=theirs)

    def scatter(self, index: Tensor, batch: "DecoderStreamState") -> None:
        """Write `batch`'s rows back to this state's rows at `index` (what `gather` took, advanced)."""
        for mine, theirs in zip(self.tensors(), batch.tensors()):
            mine.index_copy_(0, index, theirs)
