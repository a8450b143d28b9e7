"""Talker-side grouping of frames into connector chunks: a small first chunk for a fast first packet, then chunks
that double up to `codec_chunk_frames` (1, 2, 4, 8, 16, 25, 25, ...), so that the player's second packet does not
wait a whole `codec_chunk_frames` of talker steps behind its first, and code2wav has frames to decode meanwhile
(the stalls this removes: `docs/benchmarks.md`, "Chunks double"). The remainder is flushed when the request ends,
or early (`flush`) when the request waits for text that has not arrived: frames already made must not wait for
words still to come."""
from __future__ import annotations

import numpy as np


class FrameChunker:
    def __init__(self, initial_codec_chunk_frames: int, codec_chunk_frames: int) -> None:
        self.initial_codec_chunk_frames, self.codec_chunk_frames = initial_codec_chunk_frames, codec_chunk_frames
        self.frames: list[np.ndarray] = []
        self.num_chunks = 0

    def add(self, frame: np.ndarray | None, finished: bool) -> np.ndarray | None:
        """Add one [16] frame (None when the request ends without one); returns a [F, 16] chunk when one is due.
        At the end the remainder is returned, possibly with F = 0 (a bare end marker)."""
        if frame is not None:
            self.frames.append(frame)
        target = (self.initial_codec_chunk_frames if self.num_chunks == 0
                  else min(self.codec_chunk_frames, self.initial_codec_chunk_frames << self.num_chunks))
        if not finished and len(self.frames) < target:
            return None
        chunk = np.stack(self.frames).astype(np.int32) if self.frames else np.zeros((0, 16), np.int32)
        self.frames = []
        self.num_chunks += 1
        return chunk

    def flush(self) -> np.ndarray | None:
        """The frames held so far as a chunk, or None when there are none."""
        if not self.frames:
            return None
        return self.add(None, finished=True)
