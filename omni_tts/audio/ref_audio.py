"""Reference audio for voice cloning from a request: a `data:` base64 URI, an http(s) URL, or an allow-listed file.

Everything here is untrusted input. Accepted forms of the `ref_audio` string (serving contract §2):

- `data:[<mediatype>][;params];base64,<data>` — the media type is not trusted (the bytes are sniffed by
  libsndfile); whitespace and missing `=` padding in the base64 are tolerated, URL-safe `-`/`_` too. The encoded
  length is checked against `max_bytes` before anything is decoded. Raw base64 without the `data:` prefix is
  **refused** on purpose: the base64 alphabet contains `/`, so a bare base64 string cannot be told apart from an
  absolute path, and a typo would produce a misleading error.
- `http://…` / `https://…` — only through a fetcher (url_fetch.RemoteAudioFetcher: the server has one only when
  started with `--allow-remote-ref-audio`); an answer that is not audio gives the same `URL_FAILED` as every other
  failed fetch.
- `file:///abs/path` (or `file://localhost/…`, percent-encoding decoded) or a bare absolute path — only when the
  server names an allowed directory, and only if the fully resolved path (symlinks and `..` resolved) lies inside
  it; the opened descriptor is checked again, so a symlink swapped in between check and open cannot escape.

Any libsndfile-readable container is accepted (wav, flac, ogg/vorbis/opus, mp3, aiff, …); the clip is averaged to
mono, resampled to 24 kHz (`omni_tts.models.qwen3_tts.audio`), and its duration must lie in [min_seconds,
max_seconds] (1–30 s by default, measured before resampling). Decompression bombs: a header claiming more than the
limit is refused before decoding, and decoding stops a second past the limit whatever the header said (compressed
formats may not know their length).

Errors: every failure raises `RefAudioError(message, status)`; `status` is 413 when the clip is larger than
`max_bytes`, 429 when too many URL fetches run, and 400 for everything else. Messages start with the field name
(`ref_audio` by default), never carry library text (libsndfile, aiohttp), and are meant to be shown to users
verbatim.

Event loop: base64 decoding, file reads, audio decoding and resampling all run in the given executor; only the
async HTTP read runs on the loop.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import logging
import math
import os
import stat
import urllib.parse
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import soundfile as sf

from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE, load_audio, resample_to

logger = logging.getLogger(__name__)

MAX_BYTES = 10 * 1024 * 1024
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0
MIN_SOURCE_RATE, MAX_SOURCE_RATE = 8000, 384000   # below 8 kHz is not speech audio; above is nonsense for a voice
MAX_CHANNELS = 16
URL_FAILED = ("ref_audio URL could not be fetched: it must be an http(s) URL of a public host that answers 200 "
              "with an audio file")
_UNKNOWN_LENGTH = 2 ** 63 - 1  # libsndfile's frame count for a stream of unknown length
_URL_SAFE = str.maketrans("-_", "+/")


class RefAudioError(ValueError):
    """Unusable reference audio; `status` is the HTTP status to answer (400, 413 when too large, 429 when busy)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class NotAudioError(RefAudioError):
    """The bytes are not audio libsndfile can read (a fetched URL answers with `URL_FAILED` instead)."""


@dataclass(frozen=True)
class DecodedClip:
    samples: np.ndarray      # float32 mono at 24 kHz
    source_rate: int         # sample rate of the file as given
    duration_s: float        # duration before resampling
    format: str              # libsndfile major format: WAV, WAVEX, FLAC, OGG, MP3, …
    subtype: str             # libsndfile subtype: PCM_16, VORBIS, OPUS, MPEG_LAYER_III, …


def too_large(label: str, max_bytes: int) -> RefAudioError:
    """413: the clip is larger than `max_bytes`."""
    return RefAudioError(f"{label} is larger than the {max_bytes}-byte limit ({max_bytes / 2**20:g} MiB)", 413)


def _not_audio(label: str) -> NotAudioError:
    return NotAudioError(f"{label} is not a readable audio file; send wav, flac, ogg or mp3")


def _bad_duration(label: str, min_seconds: float, max_seconds: float, got: str, what: str) -> RefAudioError:
    return RefAudioError(f"{label} is too {what}: it must last {min_seconds:g}–{max_seconds:g} s, got {got}")


def decode_reference(data: bytes, *, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS,
                     label: str = "ref_audio") -> DecodedClip:
    """Encoded audio file bytes → `DecodedClip` (24 kHz mono float32), duration checked. Blocking: run off the loop.

    The header is read first (`soundfile.info`): a file whose header claims more than `max_seconds` is refused
    before it is decoded, and decoding stops a second past `max_seconds` whatever the header said.
    """
    if not data:
        raise RefAudioError(f"{label} is empty (0 bytes)")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # libsndfile raises LibsndfileError / RuntimeError / TypeError for junk
        logger.info("%s: libsndfile cannot read its header: %s", label, e)
        raise _not_audio(label) from None
    if not MIN_SOURCE_RATE <= info.samplerate <= MAX_SOURCE_RATE:
        raise RefAudioError(f"{label} has sample rate {info.samplerate} Hz; supported: "
                            f"{MIN_SOURCE_RATE}–{MAX_SOURCE_RATE} Hz")
    if not 1 <= info.channels <= MAX_CHANNELS:
        raise RefAudioError(f"{label} has {info.channels} channels; at most {MAX_CHANNELS} are supported")
    # frame counts of compressed formats are estimates: refuse from the header only when clearly too long
    if 0 < info.frames < _UNKNOWN_LENGTH and info.frames / info.samplerate > max_seconds + 1.0:
        raise _bad_duration(label, min_seconds, max_seconds, f"{info.frames / info.samplerate:.2f} s", "long")
    max_samples = None if math.isinf(max_seconds) else math.ceil((max_seconds + 1.0) * info.samplerate)
    try:
        wav, sr = load_audio(data, max_samples=max_samples)
    except ValueError as e:
        logger.info("%s: libsndfile cannot decode it: %s", label, e)
        raise _not_audio(label) from None
    if max_samples is not None and wav.shape[0] >= max_samples:  # decoding stopped at the cap
        raise _bad_duration(label, min_seconds, max_seconds, f"more than {max_seconds + 1.0:g} s", "long")
    seconds = wav.shape[0] / sr
    if not min_seconds <= seconds <= max_seconds:
        raise _bad_duration(label, min_seconds, max_seconds, f"{seconds:.2f} s",
                            "short" if seconds < min_seconds else "long")
    samples = np.ascontiguousarray(resample_to(wav, sr, SAMPLE_RATE), dtype=np.float32)
    return DecodedClip(samples, int(sr), float(seconds), str(info.format), str(info.subtype))


def decode_clip(data: bytes, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS,
                label: str = "ref_audio") -> np.ndarray:
    """Encoded audio file bytes → float32 mono at 24 kHz, with the duration checked (see `decode_reference`)."""
    return decode_reference(data, min_seconds=min_seconds, max_seconds=max_seconds, label=label).samples


# --- data: URIs --------------------------------------------------------------------------------------------------
def decode_data_uri(value: str, max_bytes: int = MAX_BYTES) -> bytes:
    """`data:[mediatype][;params];base64,<data>` → the decoded bytes. Blocking for large values: run off the loop."""
    value = value.strip()
    comma = value.find(",")
    if not value[:5].lower() == "data:" or comma < 0:
        raise RefAudioError("ref_audio data URI is malformed: expected data:audio/wav;base64,<data>")
    params = [p.strip().lower() for p in value[5:comma].split(";")]
    if "base64" not in params[1:]:
        raise RefAudioError("ref_audio data URI must be base64 encoded: data:audio/wav;base64,<data>")
    payload = value[comma + 1:]
    if any(ws in payload for ws in (" ", "\n", "\r", "\t")):
        payload = "".join(payload.split())
    if not payload:
        raise RefAudioError("ref_audio data URI holds no data")
    if (len(payload) // 4) * 3 > max_bytes + 3:
        raise too_large("ref_audio", max_bytes)
    if "-" in payload or "_" in payload:
        payload = payload.translate(_URL_SAFE)
    payload += "=" * (-len(payload) % 4)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RefAudioError("ref_audio data URI holds invalid base64") from None
    if len(data) > max_bytes:
        raise too_large("ref_audio", max_bytes)
    return data


# --- local files -------------------------------------------------------------------------------------------------
def _local_path(value: str) -> str:
    if value[:5].lower() == "file:":
        parsed = urllib.parse.urlsplit(value)
        if parsed.netloc not in ("", "localhost"):
            raise RefAudioError("ref_audio file URL must name a local absolute path: file:///path/to/clip.wav")
        if parsed.query or parsed.fragment:
            raise RefAudioError("ref_audio file URL must not contain '?' or '#' (percent-encode them)")
        path = urllib.parse.unquote(parsed.path)
    else:
        path = value
    if "\0" in path:
        raise RefAudioError("ref_audio path contains a NUL byte")
    if not os.path.isabs(path):
        raise RefAudioError("ref_audio file path must be absolute")
    return path


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def read_local_file(value: str, allowed_local_path: str | None, max_bytes: int = MAX_BYTES) -> bytes:
    """`file:///…` or an absolute path inside `allowed_local_path` → its bytes. Blocking: run off the loop."""
    if not allowed_local_path:
        raise RefAudioError("ref_audio local files are disabled on this server (start it with "
                            "--allowed-local-media-path); send a data: URI or an http(s) URL instead")
    path = _local_path(value)
    root = os.path.realpath(allowed_local_path)
    real = os.path.realpath(path)  # resolves every symlink and '..'
    if not _inside(real, root):
        raise RefAudioError(f"ref_audio path {path!r} is outside the allowed local media directory")
    try:
        # O_NONBLOCK: a FIFO inside the directory must not hang the worker; O_NOFOLLOW: the last component is
        # already resolved, so a symlink here means it was swapped in after the check
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise RefAudioError(f"ref_audio file not found: {path}") from None
    except OSError as e:
        raise RefAudioError(f"ref_audio file cannot be opened: {path} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefAudioError(f"ref_audio path is not a regular file: {path}")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        proc = f"/proc/self/fd/{f.fileno()}"
        if os.path.exists(proc) and not _inside(os.path.realpath(proc), root):  # an intermediate directory moved
            raise RefAudioError(f"ref_audio path {path!r} is outside the allowed local media directory")
        if st.st_size > max_bytes:
            raise too_large("ref_audio", max_bytes)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise too_large("ref_audio", max_bytes)
    return data


class AudioFetcher(Protocol):
    """What fetches http(s) ref_audio (url_fetch.RemoteAudioFetcher)."""

    async def fetch(self, url: str, max_bytes: int) -> bytes: ...


# --- entry point -------------------------------------------------------------------------------------------------
def _data_uri_to_clip(value: str, max_bytes: int, min_seconds: float, max_seconds: float) -> np.ndarray:
    return decode_clip(decode_data_uri(value, max_bytes), min_seconds, max_seconds)


def _local_to_clip(value: str, allowed: str | None, max_bytes: int, min_seconds: float,
                   max_seconds: float) -> np.ndarray:
    return decode_clip(read_local_file(value, allowed, max_bytes), min_seconds, max_seconds)


async def fetch_ref_audio(value: str, *, allowed_local_path: str | None, fetcher: AudioFetcher | None,
                          executor: concurrent.futures.Executor, max_bytes: int = MAX_BYTES,
                          min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """The request's `ref_audio` string → float32 mono samples at 24 kHz; `RefAudioError` otherwise.

    `fetcher=None`: http(s) URLs are refused. Returns a fresh array the caller may keep.
    """
    if not isinstance(value, str) or not value.strip():
        raise RefAudioError("ref_audio must be a non-empty string")
    loop = asyncio.get_running_loop()
    head = value[:16].lstrip().lower()
    if head.startswith("data:"):
        # cheap bound before any copy: base64 is 4/3 of the data, plus generous room for line breaks
        if len(value) > (max_bytes * 4) // 3 * 1.1 + 4096:
            raise too_large("ref_audio", max_bytes)
        return await loop.run_in_executor(executor, _data_uri_to_clip, value, max_bytes, min_seconds, max_seconds)
    value = value.strip()
    if head.startswith(("http://", "https://")):
        if fetcher is None:
            raise RefAudioError("ref_audio: URLs are disabled on this server; send a data: URI")
        data = await fetcher.fetch(value, max_bytes)
        try:
            return await loop.run_in_executor(executor, decode_clip, data, min_seconds, max_seconds)
        except NotAudioError:
            raise RefAudioError(URL_FAILED) from None  # an HTML page is one more failed fetch: say nothing more
    if head.startswith("file:") or os.path.isabs(value):
        return await loop.run_in_executor(executor, _local_to_clip, value, allowed_local_path, max_bytes,
                                          min_seconds, max_seconds)
    raise RefAudioError("ref_audio must be a data URI (data:audio/wav;base64,<data>), an http(s):// URL or a "
                        "file:///absolute/path; raw base64 needs the 'data:audio/wav;base64,' prefix")
