"""Chunk schedules: the frames of each connector chunk the talker cuts a request's codes into, the last repeated
(`ConnectorConfig.chunk_schedule`, `ConnectorConfig.chunk_frames`; the chunker: engine/chunker.py).

Without a schedule, chunks double from the first up to `codec_chunk_frames` (1, 2, 4, 8, 16, 25, 25, ...). The named
profiles follow Nari's `ttfa` and `balanced` ones (../shared/docs/gpu_leaders.md): `latency` keeps the first chunks
small (early first audio, more chunks to decode); `load` starts at 4 frames, so that many streams' first chunks cost
code2wav fewer calls and their players start with a buffer (fewer underruns while the device is busy); `auto` picks
one per request by the talker's load as the request starts.
"""
from __future__ import annotations

from typing import Literal

ChunkSchedule = Literal["latency", "load", "auto"] | list[int] | None
CHUNK_PROFILES: dict[str, tuple[int, ...]] = {"latency": (1, 2, 4, 8, 12), "load": (4, 4, 8, 16, 25)}
DOUBLING_DEFAULTS = (2, 25)   # initial_codec_chunk_frames, codec_chunk_frames without a chunk_schedule


def doubling_frames(first: int, most: int) -> tuple[int, ...]:
    """Chunks that double from `first` up to `most` (1, 2, 4, 8, 16, 25), the last repeated."""
    frames = [first]
    while frames[-1] < most:
        frames.append(min(2 * frames[-1], most))
    return tuple(frames) if first <= most else (first, most)


def check_profiles_fit(schedule: str, ring_slot_frames: int) -> None:
    """ValueError `chunk_schedule: …` unless every chunk of the profiles a named schedule may give fits a ring slot."""
    for name in ("latency", "load") if schedule == "auto" else (schedule,):
        if max(CHUNK_PROFILES[name]) > ring_slot_frames:
            raise ValueError(f"chunk_schedule: the {name} profile's chunks ({list(CHUNK_PROFILES[name])}) must fit "
                             f"ring_slot_frames ({ring_slot_frames})")


def scheduled_frames(schedule: str | list[int], first: int | None, num_requests: int,
                     auto_load_requests: int) -> tuple[int, ...]:
    """A request's chunk frames under a named or listed schedule: auto gives `load` from `auto_load_requests`
    requests in the talker on (`num_requests` as the request starts), else `latency`; `first` (the request's own
    first chunk), when set, replaces the first entry."""
    if isinstance(schedule, list):
        frames = tuple(schedule)
    elif schedule == "auto":
        frames = CHUNK_PROFILES["load" if num_requests >= auto_load_requests else "latency"]
    else:
        frames = CHUNK_PROFILES[schedule]
    if first is None:
        return frames
    return (first, *frames[1:]) if len(frames) > 1 else (first, frames[0])
