"""Reference audio for voice cloning from a request: a `data:` base64 URI, an http(s) URL, or an allow-listed file.

Network reads are async and size-capped; base64, decoding and resampling run in an executor, never on the loop.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import os

import aiohttp
import numpy as np

from omni_tts.models.qwen3_tts.audio import load_audio, resample_to

SAMPLE_RATE = 24000
MAX_BYTES = 10 * 1024 * 1024
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0


class RefAudioError(ValueError):
    """Unusable reference audio; `status` is the HTTP status to answer (400, or 413 when too large)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decode_clip(data: bytes, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """Encoded audio file bytes → float32 mono at 24 kHz, with the duration checked."""
    try:
        wav, sr = load_audio(data)
    except (ValueError, RuntimeError, OSError) as e:
        raise RefAudioError(f"ref_audio is not a readable audio file: {e}") from None
    seconds = wav.shape[0] / sr
    if not min_seconds <= seconds <= max_seconds:
        raise RefAudioError(f"ref_audio must last {min_seconds:g}–{max_seconds:g} s, got {seconds:.2f} s")
    return resample_to(wav, sr, SAMPLE_RATE)


def _decode_data_uri(value: str, max_bytes: int) -> bytes:
    header, _, payload = value.partition(",")
    if not header.endswith(";base64"):
        raise RefAudioError("ref_audio data URI must be base64 encoded (data:audio/...;base64,...)")
    if len(payload) * 3 // 4 > max_bytes:
        raise RefAudioError(f"ref_audio is larger than {max_bytes} bytes", 413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RefAudioError("ref_audio data URI holds invalid base64") from None


def _read_local(value: str, allowed: str | None, max_bytes: int) -> bytes:
    if allowed is None:
        raise RefAudioError("ref_audio local files are disabled (start the server with --allowed-local-media-path)")
    path = value[len("file://"):] if value.startswith("file://") else value
    root = os.path.realpath(allowed)
    real = os.path.realpath(path)  # resolves symlinks and '..', so nothing escapes the allowed directory
    if os.path.commonpath([root, real]) != root:
        raise RefAudioError("ref_audio path is outside the allowed local media directory")
    if not os.path.isfile(real):
        raise RefAudioError(f"ref_audio file not found: {path}")
    if os.path.getsize(real) > max_bytes:
        raise RefAudioError(f"ref_audio is larger than {max_bytes} bytes", 413)
    with open(real, "rb") as f:
        return f.read()


async def _fetch_url(url: str, session: aiohttp.ClientSession, max_bytes: int, timeout_s: float) -> bytes:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                raise RefAudioError(f"ref_audio URL answered HTTP {response.status}")
            data = bytearray()
            async for block in response.content.iter_chunked(64 * 1024):
                data += block
                if len(data) > max_bytes:
                    raise RefAudioError(f"ref_audio is larger than {max_bytes} bytes", 413)
            return bytes(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise RefAudioError(f"ref_audio URL could not be fetched: {type(e).__name__} {e}".strip()) from None


async def fetch_ref_audio(value: str, *, allowed_local_path: str | None, session: aiohttp.ClientSession | None,
                          executor: concurrent.futures.Executor, max_bytes: int = MAX_BYTES,
                          timeout_s: float = 10.0) -> np.ndarray:
    """The request's `ref_audio` → float32 mono samples at 24 kHz (1–30 s); RefAudioError otherwise."""
    loop = asyncio.get_running_loop()
    value = value.strip()
    if value.startswith("data:"):
        data = await loop.run_in_executor(executor, _decode_data_uri, value, max_bytes)
    elif value.startswith(("http://", "https://")):
        if session is None:
            raise RefAudioError("ref_audio URLs are not enabled on this server")
        data = await _fetch_url(value, session, max_bytes, timeout_s)
    elif value.startswith("file://") or os.path.isabs(value):
        data = await loop.run_in_executor(executor, _read_local, value, allowed_local_path, max_bytes)
    else:
        raise RefAudioError("ref_audio must be a data: base64 URI, an http(s) URL or an absolute file path")
    return await loop.run_in_executor(executor, decode_clip, data)
