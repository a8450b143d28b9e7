"""Pitch-preserving speed change for the `speed` request field (0.25–4.0).

Uses FFmpeg's ``atempo`` filter through PyAV (the same dependency as the mp3/opus/aac/flac encoders). ``atempo`` is
a WSOLA-style time-scale modification: overlapping windows of the input are re-spaced at the new tempo and aligned by
cross-correlation before overlap-add, so duration changes while pitch and formants stay put. One ``atempo``
instance accepts tempos in [0.5, 100]; tempos below 0.5 are applied as two equal stages (√speed each), as FFmpeg's
documentation recommends.

The result is trimmed or zero-padded to exactly ``round(len(samples) / speed)`` samples (the filter's own output can
differ from that by part of a window); a trimmed end gets a 5 ms fade-out so the cut cannot click.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE

__all__ = ["MAX_SPEED", "MIN_SPEED", "change_speed", "check_speed"]

MIN_SPEED = 0.25
MAX_SPEED = 4.0
_ATEMPO_MIN = 0.5
_FADE_S = 0.005


def check_speed(speed: float) -> float:
    """Return `speed` as a float, or raise ValueError unless it is a finite number in [0.25, 4.0]."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float, np.integer, np.floating)):
        raise ValueError(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
    value = float(speed)
    if not math.isfinite(value) or not MIN_SPEED <= value <= MAX_SPEED:
        raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
    return value


def change_speed(samples: np.ndarray, speed: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Play mono `samples` `speed` times faster (speed < 1: slower) without changing pitch.

    Returns a new float32 array of ``round(len(samples) / speed)`` samples; ``speed == 1.0`` returns `samples`
    itself, untouched. Raises ValueError for a speed outside [0.25, 4.0], a bad rate or non-1-D input.
    """
    speed = check_speed(speed)
    if speed == 1.0:
        return samples
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive integer, got {sample_rate!r}")
    x = np.asarray(samples)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ValueError(f"expected mono audio as a 1-D array, got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    target = int(round(x.size / speed))
    if x.size == 0:
        return np.zeros(0, dtype=np.float32)

    y = _atempo(x, speed, int(sample_rate))
    if y.size >= target:
        trimmed = y.size > target
        y = y[:target].copy()
        if trimmed:
            n = min(target, max(1, int(_FADE_S * sample_rate)))
            y[target - n:] *= np.linspace(1.0, 0.0, n, dtype=np.float32)
        return y
    return np.concatenate([y, np.zeros(target - y.size, dtype=np.float32)])


def _atempo(x: np.ndarray, speed: float, sample_rate: int) -> np.ndarray:
    import av
    import av.filter

    stages = [speed] if speed >= _ATEMPO_MIN else [math.sqrt(speed)] * 2
    time_base = Fraction(1, sample_rate)
    graph = av.filter.Graph()
    nodes = [graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono", time_base=time_base)]
    nodes += [graph.add("atempo", f"{s:.12g}") for s in stages]
    nodes.append(graph.add("abuffersink"))
    for a, b in zip(nodes, nodes[1:]):
        a.link_to(b)
    graph.configure()

    frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = sample_rate
    frame.time_base = time_base
    frame.pts = 0
    graph.push(frame)
    graph.push(None)  # end of stream: flush the filter's buffered windows

    out: list[np.ndarray] = []
    while True:
        try:
            res = graph.pull()
        except (av.error.EOFError, av.error.BlockingIOError):
            break
        out.append(np.asarray(res.to_ndarray(), dtype=np.float32).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
