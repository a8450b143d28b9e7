"""16-bit PCM, the one float → int16 conversion (`to_int16`, for pcm, wav and flac, whole files and streams alike),
the WAV header, the format names, and the stream encoders' interface with its two PyAV-free implementations (pcm,
wav). The codecs (PyAV) and content types are encoding.py's."""
from __future__ import annotations

import struct
from typing import Protocol, runtime_checkable

import numpy as np

FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")

_INT16_SCALE = 32767.0
_WAV_UNKNOWN_SIZE = 0xFFFFFFFF


def normalize_format(fmt: str) -> str:
    """Return the canonical (lower-case) format name, or raise ``ValueError`` naming the supported formats."""
    if isinstance(fmt, str):
        name = fmt.strip().lower()
        if name in FORMATS:
            return name
    raise ValueError(f"unsupported audio format {fmt!r}: expected one of {', '.join(FORMATS)}")


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float audio → int16: NaN → 0, clip to [-1, 1], × 32767, round half to even; a new 1-D int16 array."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.rint(np.clip(x, -1.0, 1.0) * np.float32(_INT16_SCALE)).astype(np.int16)


def pcm_bytes(samples: np.ndarray) -> bytes:
    return to_int16(samples).astype("<i2", copy=False).tobytes()


def wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """44-byte canonical RIFF/WAVE header for 16-bit mono PCM.

    ``num_samples=None`` gives the streaming header: RIFF and data chunk sizes both ``0xFFFFFFFF``.
    """
    sample_rate = check_rate(sample_rate)
    if num_samples is None:
        riff_size = data_size = _WAV_UNKNOWN_SIZE
    else:
        data_size = 2 * int(num_samples)
        if data_size + 36 > _WAV_UNKNOWN_SIZE:
            raise ValueError(f"{num_samples} samples do not fit in a WAV file (4 GiB limit)")
        riff_size = 36 + data_size
    channels, bits = 1, 16
    block_align = channels * bits // 8
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff_size, b"WAVE",
        b"fmt ", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, bits,
        b"data", data_size,
    )


def check_rate(sample_rate: int) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive integer, got {sample_rate!r}")
    return int(sample_rate)


def check_samples(samples: np.ndarray) -> np.ndarray:
    x = np.asarray(samples)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ValueError(f"expected mono audio as a 1-D array, got shape {x.shape}")
    if x.dtype.kind not in "fiu":
        raise ValueError(f"expected float audio samples, got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)




@runtime_checkable
class StreamEncoder(Protocol):
    """One encoder per streamed response. Call ``start()`` once, ``encode()`` per chunk, ``finish()`` once.

    Every call returns the bytes to send next (possibly ``b""``); their concatenation is one valid stream.
    ``encode``/``finish`` implicitly ``start`` if it was not called. Calls after ``finish``/``close`` raise
    RuntimeError. Not thread-safe: one stream, one caller at a time (any thread, e.g. an executor).
    """

    fmt: str
    sample_rate: int

    def start(self) -> bytes: ...

    def encode(self, chunk: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...

    def close(self) -> None:
        """Drop the stream without more output (client gone); idempotent, also after finish()."""


class BaseStreamEncoder:
    fmt: str

    def __init__(self, sample_rate: int):
        self.sample_rate = check_rate(sample_rate)
        self._started = False
        self._finished = False

    def _begin(self) -> bytes:
        return b""

    def _encode(self, chunk: np.ndarray) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def _end(self) -> bytes:
        return b""

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(f"{self.fmt} stream encoder already finished")

    def start(self) -> bytes:
        self._check_open()
        if self._started:
            return b""
        self._started = True
        return self._begin()

    def encode(self, chunk: np.ndarray) -> bytes:
        head = self.start()
        x = check_samples(chunk)
        return head + self._encode(x) if x.size else head

    def finish(self) -> bytes:
        head = self.start()
        self._finished = True
        return head + self._end()

    def close(self) -> None:
        self._finished = True


class PcmStreamEncoder(BaseStreamEncoder):
    """Raw 16-bit little-endian mono PCM, no header."""

    fmt = "pcm"

    def _encode(self, chunk: np.ndarray) -> bytes:
        return pcm_bytes(chunk)


class WavStreamEncoder(PcmStreamEncoder):
    """One 44-byte RIFF header with both size fields 0xFFFFFFFF, then raw 16-bit PCM."""

    fmt = "wav"

    def _begin(self) -> bytes:
        return wav_header(self.sample_rate, None)

