"""Output sample rates: the rates a response may carry, and the resampler that brings the model's audio to one.

One `Resampler` per stream: soxr keeps its filter's state between chunks, so a stream resampled chunk by chunk is
bit-identical to the same audio resampled whole, and to soxr's one-shot `soxr.resample` (tests/audio check all
three), whatever the chunk sizes. A whole file goes through the same class in one chunk.
"""
from __future__ import annotations

import numpy as np

SAMPLE_RATES: tuple[int, ...] = (8000, 16000, 22050, 24000, 44100, 48000)
_QUALITY = "HQ"  # soxr's default for soxr.resample: 20-bit precision, far below 16-bit output's step


class Resampler:
    """float32 mono audio at `input_rate` → `output_rate`, chunk by chunk; the identity when the rates are equal."""

    def __init__(self, input_rate: int, output_rate: int) -> None:
        self.input_rate, self.output_rate = input_rate, output_rate
        self._stream = None
        if input_rate != output_rate:
            import soxr

            self._stream = soxr.ResampleStream(input_rate, output_rate, 1, dtype="float32", quality=_QUALITY)

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        """The output this chunk completes (soxr holds back its filter's look-ahead until `flush`)."""
        if self._stream is None:
            return chunk
        return self._stream.resample_chunk(chunk, last=False)

    def flush(self) -> np.ndarray:
        """The held-back tail, at the end of the stream."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
