"""Uncompressed outputs: the one float → int16 conversion (`to_int16`, for pcm, wav, flac and G.711, whole files
and streams alike), the WAV header, the format names, and the stream encoders' interface with its PyAV-free
implementations (16-bit PCM and G.711 samples, raw or in WAV). The codecs (PyAV), the sample-rate rule and the
content types are encoding.py's."""
from __future__ import annotations

import struct
from collections.abc import Callable
from typing import BinaryIO, NamedTuple, Protocol, runtime_checkable

import numpy as np

from omni_tts.audio.g711 import alaw_bytes, ulaw_bytes
from omni_tts.audio.resample import Resampler

FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm", "ulaw", "alaw", "ulaw_wav", "alaw_wav")


class SampleCoding(NamedTuple):
    """How an uncompressed format stores one sample, raw or in WAV."""
    to_bytes: Callable[[np.ndarray], bytes]  # int16 samples → bytes
    wav_format_tag: int
    bits: int


_CODINGS = {"pcm": SampleCoding(lambda pcm16: pcm16.astype("<i2", copy=False).tobytes(), 1, 16),
            "ulaw": SampleCoding(ulaw_bytes, 7, 8),
            "alaw": SampleCoding(alaw_bytes, 6, 8)}
# the uncompressed formats: their sample coding, and whether a WAV header leads
UNCOMPRESSED: dict[str, tuple[str, bool]] = {"pcm": ("pcm", False), "wav": ("pcm", True),
                                             "ulaw": ("ulaw", False), "ulaw_wav": ("ulaw", True),
                                             "alaw": ("alaw", False), "alaw_wav": ("alaw", True)}

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


def wav_header(sample_rate: int, num_samples: int | None, coding: str = "pcm") -> bytes:
    """RIFF/WAVE header for mono `coding` samples: for 16-bit PCM the canonical 44 bytes; for G.711 (format tag 7
    mu-law, 6 A-law, 8 bits) 58 bytes, with the 18-byte fmt chunk and the fact chunk non-PCM WAV files carry.

    ``num_samples=None`` gives the streaming header: every size field ``0xFFFFFFFF`` ("unknown").
    """
    sample_rate = check_rate(sample_rate)
    spec = _CODINGS[coding]
    block_align = spec.bits // 8
    extra = b"" if coding == "pcm" else struct.pack("<H4sII", 0, b"fact", 4,
                                                    _WAV_UNKNOWN_SIZE if num_samples is None else int(num_samples))
    if num_samples is None:
        riff_size = data_size = _WAV_UNKNOWN_SIZE
    else:
        data_size = block_align * int(num_samples)
        riff_size = 36 + len(extra) + data_size
        if riff_size > _WAV_UNKNOWN_SIZE:
            raise ValueError(f"{num_samples} samples do not fit in a WAV file (4 GiB limit)")
    fmt_chunk = struct.pack("<HHIIHH", spec.wav_format_tag, 1, sample_rate, sample_rate * block_align, block_align,
                            spec.bits)
    return (struct.pack("<4sI4s4sI", b"RIFF", riff_size, b"WAVE", b"fmt ", 16 + (2 if extra else 0)) + fmt_chunk
            + extra + struct.pack("<4sI", b"data", data_size))


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
    sample_rate: int  # what the output carries; the input is resampled to it

    def start(self) -> bytes: ...

    def encode(self, chunk: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...

    def close(self) -> None:
        """Drop the stream without more output (client gone); idempotent, also after finish()."""


class BaseStreamEncoder:
    """The lifecycle, and the stream's one resampler from `input_rate` to `sample_rate` in front of `_encode`."""
    fmt: str

    def __init__(self, input_rate: int, sample_rate: int):
        self.input_rate, self.sample_rate = check_rate(input_rate), check_rate(sample_rate)
        self._resampler = Resampler(self.input_rate, self.sample_rate)
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
        x = self._resampler(check_samples(chunk))
        return head + self._encode(x) if x.size else head

    def finish(self) -> bytes:
        head = self.start()
        tail = self._resampler.flush()
        body = self._encode(tail) if tail.size else b""
        self._finished = True
        return head + body + self._end()

    def close(self) -> None:
        self._finished = True


class RawStreamEncoder(BaseStreamEncoder):
    """Uncompressed samples (16-bit little-endian PCM, or G.711 mu-law / A-law bytes), mono, no header."""

    def __init__(self, fmt: str, input_rate: int, sample_rate: int):
        super().__init__(input_rate, sample_rate)
        self.fmt = fmt
        self._coding = UNCOMPRESSED[fmt][0]
        self._to_bytes = _CODINGS[self._coding].to_bytes

    def _encode(self, chunk: np.ndarray) -> bytes:
        return self._to_bytes(to_int16(chunk))


class WavStreamEncoder(RawStreamEncoder):
    """A WAV header, then the samples. Streamed, the header comes first with every size 0xFFFFFFFF; a whole file
    goes into the seekable `out` its bytes are written to, whose header `finish` rewrites with the sizes."""

    def __init__(self, fmt: str, input_rate: int, sample_rate: int, out: BinaryIO | None = None):
        super().__init__(fmt, input_rate, sample_rate)
        self._out = out
        self._samples = 0

    def _begin(self) -> bytes:
        return wav_header(self.sample_rate, None, self._coding)  # a whole file's sizes are written at the end

    def _encode(self, chunk: np.ndarray) -> bytes:
        self._samples += chunk.size
        return super()._encode(chunk)

    def _end(self) -> bytes:
        if self._out is not None:
            end = self._out.tell()
            self._out.seek(0)
            self._out.write(wav_header(self.sample_rate, self._samples, self._coding))
            self._out.seek(end)
        return b""
