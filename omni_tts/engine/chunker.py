"""Talker-side grouping of frames into connector chunks, by the request's chunk schedule: the frames of its first
chunks, the last repeated (`ConnectorConfig.chunk_frames`: today's doubling 1, 2, 4, 8, 16, 25, 25, ... or a named
profile). A small first chunk gives a fast first packet, and growing chunks keep the player's second packet from
waiting a whole steady chunk of talker steps behind it while code2wav has frames to decode meanwhile (the stalls
this removes: `docs/benchmarks.md`, "Chunks double"). The remainder is flushed when the request ends, or early
(`flush`) when the request waits for text that has not arrived: frames already made must not wait for words still
to come."""
from __future__ import annotations

import numpy as np


class FrameChunker:
    def __init__(self, chunk_frames: tuple[int, ...]) -> None:
        """chunk_frames: the frames of chunk 0, 1, ...; the last repeats."""
        self.chunk_frames = chunk_frames
        self.frames: list[np.ndarray] = []
        self.num_chunks = 0

    def add(self, frame: np.ndarray | None, finished: bool) -> np.ndarray | None:
        """Add one [16] frame (None when the request ends without one); returns a [F, 16] chunk when one is due.
        At the end the remainder is returned, possibly with F = 0 (a bare end marker)."""
        if frame is not None:
            self.frames.append(frame)
        target = self.chunk_frames[min(self.num_chunks, len(self.chunk_frames) - 1)]
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
