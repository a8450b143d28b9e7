"""The streaming state of the speech decoder: exactly the past each causal layer still needs.

What each layer keeps between chunks:
  - causal conv (kernel k, dilation d): its last (k-1)*d input samples (zeros before the stream starts, which is
    exactly the left zero padding of a one-pass decode);
  - causal transposed conv (kernel k, stride s): the k-s output samples that the next input still overlap-adds
    into, kept WITHOUT bias (the bias is added once, when a sample is emitted);
  - attention layer: the last `sliding_window - 1` rotated keys / values (the window includes the current frame),
    right-aligned in a fixed-size buffer; slots before the start of the stream are masked out;
  - `position`: frames already decoded per request, i.e. the absolute RoPE position of the next frame.
All state tensors are batch-first and fixed-size, and are updated in place, so states of requests at different
stream offsets can be stacked into one batch (`DecoderStreamState.stack`) and split again (`unbind`).
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

    def _tensors(self) -> list[Tensor]:
        return [self.position, *self.conv, *self.overlap, *self.keys, *self.values]

    def _from_tensors(self, tensors: list[Tensor]) -> "DecoderStreamState":
        """A state of the same layout as `self` holding `tensors` (in `_tensors` order)."""
        it = iter(tensors)
        position = next(it)
        conv = [next(it) for _ in self.conv]
        overlap = [next(it) for _ in self.overlap]
        keys = [next(it) for _ in self.keys]
        values = [next(it) for _ in self.values]
        return DecoderStreamState(position, conv, overlap, keys, values)

    @staticmethod
    def stack(states: list["DecoderStreamState"]) -> "DecoderStreamState":
        """Concatenate the states of several requests (any stream offsets) into one batch; copies."""
        if not states:
            raise ValueError("DecoderStreamState.stack needs at least one state")
        columns = zip(*(s._tensors() for s in states))
        return states[0]._from_tensors([torch.cat(column, dim=0) for column in columns])

    def unbind(self) -> list["DecoderStreamState"]:
        """Split a batched state into independent batch-1 states (copies, so the batch can be freed)."""
        return [self.select(i) for i in range(self.batch_size)]

    def select(self, i: int) -> "DecoderStreamState":
        """Row `i` as an independent batch-1 state (a copy)."""
        return self._from_tensors([t[i:i + 1].clone() for t in self._tensors()])
