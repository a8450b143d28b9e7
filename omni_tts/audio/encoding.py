"""Audio encoding for `/v1/audio/speech`: whole files and incremental streams.

Input everywhere is float32 mono audio in [-1, 1] (Qwen3-TTS produces 24 kHz).

Formats (OpenAI `response_format`):

| fmt    | bytes produced                                   | content type | encoder                     |
|--------|--------------------------------------------------|--------------|-----------------------------|
| `pcm`  | 16-bit signed little-endian mono, no header      | `audio/pcm`  | :func:`to_int16`            |
| `wav`  | 44-byte RIFF/WAVE header + 16-bit PCM            | `audio/wav`  | :func:`to_int16` + header   |
| `flac` | native FLAC (`fLaC` stream), 16-bit, lossless    | `audio/flac` | FFmpeg `flac` (PyAV)        |
| `mp3`  | MPEG audio, 64 kb/s CBR                          | `audio/mpeg` | LAME (`libmp3lame`, PyAV)   |
| `opus` | Opus in Ogg, 32 kb/s                             | `audio/ogg`  | libopus (PyAV), Ogg muxer   |
| `aac`  | AAC-LC in ADTS frames, 64 kb/s                   | `audio/aac`  | FFmpeg native `aac` (PyAV)  |

`pcm` is labelled `audio/pcm`, the convention of OpenAI-compatible TTS servers (the format carries no rate in its
name: it is `sample_rate` Hz, 16-bit LE, mono; 24 kHz for Qwen3-TTS). Servers that prefer the generic label may send
`application/octet-stream` instead; nothing here depends on it.

**int16 conversion** (:func:`to_int16`, shared by `pcm`, `wav`, `flac`, whole-file and streaming alike): NaN → 0,
clip to [-1, 1], multiply by 32767, round half to even (`np.rint`), cast to int16. So ±1.0 → ±32767 (never -32768).

**Sample rates.** Each codec is fed the input rate when it supports it (24 kHz: all of them). Otherwise the audio is
resampled with soxr (HQ) to the smallest rate the codec supports above the input rate (or its highest rate):
libopus takes 8/12/16/24/48 kHz, LAME 8–48 kHz (MPEG 1/2/2.5 rates), AAC the MPEG-4 rates, FLAC/WAV/PCM any rate.
:func:`encoded_sample_rate` tells which rate a format will carry. Ogg Opus always records the input rate in its
header and decodes at 48 kHz in most decoders; that is normal for Opus.

**Empty audio** is rejected by :func:`encode_audio` with ``ValueError``: an empty result is an error for the speech
endpoint (serving contract: "empty result → error, never an empty 200"). A stream encoder that is finished without
any audio still returns its (header-only) bytes, because the response has already started.

**Streaming** (:func:`create_stream_encoder`): one encoder and one container per response, never a header per chunk.

* `pcm`: raw int16 bytes per chunk; the concatenation equals :func:`encode_audio`'s output.
* `wav`: :meth:`StreamEncoder.start` returns one 44-byte header whose RIFF and data size fields are both
  ``0xFFFFFFFF`` ("unknown length", as vllm-omni sends), then raw int16 bytes per chunk.
* `mp3`, `opus`, `aac`, `flac`: one PyAV encoder writing into a non-seekable sink; each call returns the bytes the
  codec and muxer released so far (encoders hold back a few ms of look-ahead; FLAC releases per 4608-sample block;
  Ogg pages are closed every 20 ms packet when streaming so that no audio waits for the next chunk).
  Caveats of streamed (non-seekable) output, inherent to the formats: streamed MP3 has no Xing/LAME gapless header,
  so decoders output the encoder delay (~1105 samples of leading silence) and the last frame's padding; ADTS AAC
  never carries gapless info (1024 priming samples, also in whole files); streamed FLAC's STREAMINFO has total
  samples = 0 ("unknown") and no MD5, which FFmpeg/libFLAC accept but libsndfile (``soundfile.read``) rejects.
  Whole files are written to a seekable buffer, so their MP3 (Xing/LAME header) and FLAC (STREAMINFO) headers are
  complete and MP3/Opus/FLAC decode to the exact input length.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from omni_tts.audio.pcm import (BaseStreamEncoder, PcmStreamEncoder, StreamEncoder, WavStreamEncoder,
                                check_rate, check_samples, normalize_format, pcm_bytes, to_int16, wav_header)
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE

_CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


@dataclass(frozen=True)
class _AvSpec:
    container: str  # FFmpeg muxer name
    codec: str  # FFmpeg encoder name
    sample_format: str  # format of the frames handed to the encoder
    bit_rate: int | None
    container_options: dict[str, str] = field(default_factory=dict)
    stream_container_options: dict[str, str] = field(default_factory=dict)


_AV_SPECS: dict[str, _AvSpec] = {
    "mp3": _AvSpec("mp3", "libmp3lame", "fltp", 64_000),
    # page_duration (µs): close an Ogg page per 20 ms Opus packet while streaming, so a chunk's audio is not held
    # back until the next chunk (the default 1 s page would delay the first audio by up to a second).
    "opus": _AvSpec("ogg", "libopus", "flt", 32_000, stream_container_options={"page_duration": "20000"}),
    "aac": _AvSpec("adts", "aac", "fltp", 64_000),
    # s16 frames come from to_int16 so that FLAC carries exactly the same samples as wav/pcm
    # (FFmpeg's own float→s16 conversion scales by 32768). No 8 KiB PADDING block: nothing rewrites tags later.
    "flac": _AvSpec("flac", "flac", "s16", None, container_options={"metadata_header_padding": "0"}),
}


def content_type(fmt: str) -> str:
    """HTTP Content-Type for a response format (``audio/pcm`` for raw PCM; see the module doc)."""
    return _CONTENT_TYPES[normalize_format(fmt)]


def _import_av():
    try:
        import av
    except ImportError as exc:  # pragma: no cover - av is a declared dependency
        raise RuntimeError("PyAV (`pip install av`) is required for mp3/opus/aac/flac encoding") from exc
    return av


_RATE_CACHE: dict[str, tuple[int, ...] | None] = {}


def _codec_rates(codec: str) -> tuple[int, ...] | None:
    if codec not in _RATE_CACHE:
        rates = _import_av().Codec(codec, "w").audio_rates
        _RATE_CACHE[codec] = tuple(sorted(rates)) if rates else None
    return _RATE_CACHE[codec]


def encoded_sample_rate(fmt: str, sample_rate: int) -> int:
    """Sample rate the encoded `fmt` stream carries for input at `sample_rate` (equal unless the codec lacks it)."""
    fmt = normalize_format(fmt)
    sample_rate = check_rate(sample_rate)
    if fmt not in _AV_SPECS:
        return sample_rate
    rates = _codec_rates(_AV_SPECS[fmt].codec)
    if rates is None or sample_rate in rates:
        return sample_rate
    higher = [r for r in rates if r >= sample_rate]
    return higher[0] if higher else rates[-1]


class _Sink:
    """Write-only, non-seekable byte sink: FFmpeg muxers then write stream-friendly output and flush per packet."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class AvStreamEncoder(BaseStreamEncoder):
    """mp3 / opus / aac / flac through one PyAV (FFmpeg) encoder and muxer for the whole stream."""

    def __init__(self, fmt: str, sample_rate: int, *, _whole_file: bool = False):
        super().__init__(sample_rate)
        fmt = normalize_format(fmt)
        if fmt not in _AV_SPECS:
            raise ValueError(f"{fmt!r} is not encoded with PyAV")
        av = _import_av()
        self.fmt = fmt
        self._spec = spec = _AV_SPECS[fmt]
        self._whole_file = _whole_file
        self.codec_sample_rate = encoded_sample_rate(fmt, self.sample_rate)
        self._resampler = None
        if self.codec_sample_rate != self.sample_rate:
            import soxr

            self._resampler = soxr.ResampleStream(self.sample_rate, self.codec_sample_rate, 1, dtype="float32",
                                                  quality="HQ")
        options = dict(spec.container_options)
        if _whole_file:
            self._out: io.BytesIO | _Sink = io.BytesIO()  # seekable: muxers complete their headers at the end
        else:
            self._out = _Sink()
            options["flush_packets"] = "1"
            options.update(spec.stream_container_options)
        self._container = av.open(self._out, "w", format=spec.container, container_options=options)
        self._stream = self._container.add_stream(spec.codec, rate=self.codec_sample_rate, layout="mono")
        ctx = self._stream.codec_context
        ctx.format = spec.sample_format
        if spec.bit_rate:
            ctx.bit_rate = spec.bit_rate
        self._time_base = Fraction(1, self.codec_sample_rate)
        self._pts = 0

    def _take(self) -> bytes:
        return b"" if self._whole_file else self._out.take()

    def _write(self, x: np.ndarray) -> None:
        if not x.size:
            return
        av = _import_av()
        if self._spec.sample_format == "s16":
            data = to_int16(x).reshape(1, -1)
        else:
            data = np.ascontiguousarray(x, dtype=np.float32).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(data, format=self._spec.sample_format, layout="mono")
        frame.sample_rate = self.codec_sample_rate
        frame.time_base = self._time_base
        frame.pts = self._pts
        self._pts += x.size
        self._container.mux(self._stream.encode(frame))

    def _begin(self) -> bytes:
        self._container.start_encoding()  # opens the codec, writes the container header
        return self._take()

    def _encode(self, chunk: np.ndarray) -> bytes:
        if self._resampler is not None:
            chunk = self._resampler.resample_chunk(chunk, last=False)
        self._write(chunk)
        return self._take()

    def _end(self) -> bytes:
        try:
            if self._resampler is not None:
                self._write(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
            self._container.mux(self._stream.encode(None))  # drain the encoder
        finally:
            self._container.close()  # writes the trailer
        if self._whole_file:
            return self._out.getvalue()
        return self._take()

    def close(self) -> None:
        """Release the encoder without producing more output (for aborted streams). Safe to call twice."""
        if not self._finished:
            self._finished = True
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - best effort on abort
                pass


def create_stream_encoder(fmt: str, sample_rate: int = SAMPLE_RATE) -> StreamEncoder:
    """A fresh :class:`StreamEncoder` for one streamed response in `fmt` (ValueError for unknown formats)."""
    fmt = normalize_format(fmt)
    if fmt == "pcm":
        return PcmStreamEncoder(sample_rate)
    if fmt == "wav":
        return WavStreamEncoder(sample_rate)
    return AvStreamEncoder(fmt, sample_rate)


# --------------------------------------------------------------------------------------------------------------------
# whole files


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode a whole clip of float32 mono `samples` at `sample_rate` Hz as one `fmt` file.

    Raises ValueError for an unknown format, a non-positive rate, non-1-D input or empty audio.
    """
    fmt = normalize_format(fmt)
    sample_rate = check_rate(sample_rate)
    x = check_samples(samples)
    if x.size == 0:
        raise ValueError("cannot encode empty audio")
    if fmt == "pcm":
        return pcm_bytes(x)
    if fmt == "wav":
        return wav_header(sample_rate, x.size) + pcm_bytes(x)
    enc = AvStreamEncoder(fmt, sample_rate, _whole_file=True)
    try:
        enc.start()
        enc.encode(x)
        return enc.finish()
    except BaseException:
        enc.close()
        raise
