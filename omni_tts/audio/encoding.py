"""Audio encoding for `/v1/audio/speech`: whole files and incremental streams.

Input everywhere is float32 mono audio in [-1, 1] at `input_rate` (Qwen3-TTS produces 24 kHz).

Formats (OpenAI `response_format`, plus G.711 for telephony):

| fmt        | bytes produced                                   | content type         | encoder                    |
|------------|--------------------------------------------------|----------------------|----------------------------|
| `pcm`      | 16-bit signed little-endian mono, no header      | `audio/pcm`          | :func:`to_int16`           |
| `wav`      | 44-byte RIFF/WAVE header + 16-bit PCM            | `audio/wav`          | :func:`to_int16` + header  |
| `ulaw`     | G.711 mu-law bytes, 8 kHz, no header             | `audio/basic`        | g711.py                    |
| `alaw`     | G.711 A-law bytes, 8 kHz, no header              | `audio/x-alaw-basic` | g711.py                    |
| `ulaw_wav` | 58-byte WAV header (format tag 7) + mu-law bytes | `audio/wav`          | g711.py + header           |
| `alaw_wav` | 58-byte WAV header (format tag 6) + A-law bytes  | `audio/wav`          | g711.py + header           |
| `flac`     | native FLAC (`fLaC` stream), 16-bit, lossless    | `audio/flac`         | FFmpeg `flac` (PyAV)       |
| `mp3`      | MPEG audio, 64 kb/s CBR                          | `audio/mpeg`         | LAME (`libmp3lame`, PyAV)  |
| `opus`     | Opus in Ogg, 32 kb/s                             | `audio/ogg`          | libopus (PyAV), Ogg muxer  |
| `aac`      | AAC-LC in ADTS frames, 64 kb/s                   | `audio/aac`          | FFmpeg native `aac` (PyAV) |

`pcm` is labelled `audio/pcm`, the convention of OpenAI-compatible TTS servers (the format carries no rate in its
name: it is `sample_rate` Hz, 16-bit LE, mono). `audio/basic` is RFC 2046's 8 kHz mono mu-law.

**int16 conversion** (:func:`to_int16`, shared by pcm, wav, flac and G.711, whole-file and streaming alike): NaN → 0,
clip to [-1, 1], multiply by 32767, round half to even (`np.rint`), cast to int16. So ±1.0 → ±32767 (never -32768).

**Sample rates** (:func:`output_sample_rate`): a response carries one of `SAMPLE_RATES` that its codec takes
(libopus: no 22050 or 44100; G.711: 8000 only); by default the input's rate (G.711: 8000). The stream encoder owns
one soxr resampler from the input rate (resample.py), so a streamed response's samples equal the whole file's.
Ogg Opus decodes at 48 kHz in most decoders whatever rate it was encoded at; that is normal for Opus.

**Empty audio** is rejected by :func:`encode_audio` with ``ValueError``: an empty result is an error for the speech
endpoint (serving contract: "empty result → error, never an empty 200"). A stream encoder that is finished without
any audio still returns its (header-only) bytes, because the response has already started.

**Streaming** (:func:`create_stream_encoder`): one encoder and one container per response, never a header per chunk.

* `pcm`, `ulaw`, `alaw`: raw bytes per chunk; the concatenation equals :func:`encode_audio`'s output.
* `wav`, `ulaw_wav`, `alaw_wav`: :meth:`StreamEncoder.start` returns one header whose size fields are all
  ``0xFFFFFFFF`` ("unknown length", as vllm-omni sends), then raw samples per chunk.
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

import functools
import io
from dataclasses import dataclass, field
from fractions import Fraction
from typing import BinaryIO

import numpy as np

from omni_tts.audio.pcm import (UNCOMPRESSED, BaseStreamEncoder, RawStreamEncoder, StreamEncoder, WavStreamEncoder,
                                check_rate, check_samples, normalize_format, to_int16)
from omni_tts.audio.resample import SAMPLE_RATES
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE

_CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
    "ulaw_wav": "audio/wav",
    "alaw_wav": "audio/wav",
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


def bit_rate(fmt: str) -> int | None:
    """The bit rate a `fmt` response is encoded at, in bits per second (None: uncompressed, or lossless)."""
    spec = _AV_SPECS.get(normalize_format(fmt))
    return spec.bit_rate if spec is not None else None


def _import_av():
    try:
        import av
    except ImportError as exc:  # pragma: no cover - av is a declared dependency
        raise RuntimeError("PyAV (`pip install av`) is required for mp3/opus/aac/flac encoding") from exc
    return av


_G711_RATE = 8000


def sample_rates(fmt: str) -> tuple[int, ...]:
    """The rates of SAMPLE_RATES a `fmt` response can carry."""
    fmt = normalize_format(fmt)
    if fmt in UNCOMPRESSED:
        return (_G711_RATE,) if UNCOMPRESSED[fmt][0] != "pcm" else SAMPLE_RATES
    return _codec_rates(_AV_SPECS[fmt].codec)


@functools.cache
def _codec_rates(codec: str) -> tuple[int, ...]:
    rates = _import_av().Codec(codec, "w").audio_rates
    return tuple(r for r in SAMPLE_RATES if not rates or r in rates)


def output_sample_rate(fmt: str, sample_rate: int | None, input_rate: int = SAMPLE_RATE) -> int:
    """The rate a `fmt` response carries when `sample_rate` is asked for (None: the input's, G.711's 8000), or
    ValueError naming the rates `fmt` takes: the one rule of which rate goes with which format."""
    fmt = normalize_format(fmt)
    accepted = sample_rates(fmt)
    if sample_rate is None:
        sample_rate = accepted[0] if len(accepted) == 1 else check_rate(input_rate)
    if sample_rate not in accepted:
        raise ValueError(f"sample_rate {sample_rate} is not available for {fmt}: expected "
                         + (f"{accepted[0]}" if len(accepted) == 1 else f"one of {', '.join(map(str, accepted))}"))
    return sample_rate


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

    def __init__(self, fmt: str, input_rate: int, sample_rate: int, *, out: BinaryIO | None = None):
        """out: a whole file's seekable destination (muxers complete their headers at the end); None: a stream."""
        super().__init__(input_rate, sample_rate)
        av = _import_av()
        self.fmt = fmt
        self._spec = spec = _AV_SPECS[fmt]
        self._whole_file = out is not None
        options = dict(spec.container_options)
        if out is not None:
            self._out: BinaryIO | _Sink = out
        else:
            self._out = _Sink()
            options["flush_packets"] = "1"
            options.update(spec.stream_container_options)
        self._container = av.open(self._out, "w", format=spec.container, container_options=options)
        self._stream = self._container.add_stream(spec.codec, rate=self.sample_rate, layout="mono")
        ctx = self._stream.codec_context
        ctx.format = spec.sample_format
        if spec.bit_rate:
            ctx.bit_rate = spec.bit_rate
        self._time_base = Fraction(1, self.sample_rate)
        self._pts = 0

    def _take(self) -> bytes:
        return b"" if self._whole_file else self._out.take()

    def _begin(self) -> bytes:
        self._container.start_encoding()  # opens the codec, writes the container header
        return self._take()

    def _encode(self, chunk: np.ndarray) -> bytes:
        av = _import_av()
        if self._spec.sample_format == "s16":
            data = to_int16(chunk).reshape(1, -1)
        else:
            data = np.ascontiguousarray(chunk, dtype=np.float32).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(data, format=self._spec.sample_format, layout="mono")
        frame.sample_rate = self.sample_rate
        frame.time_base = self._time_base
        frame.pts = self._pts
        self._pts += chunk.size
        self._container.mux(self._stream.encode(frame))
        return self._take()

    def _end(self) -> bytes:
        try:
            self._container.mux(self._stream.encode(None))  # drain the encoder
        finally:
            self._container.close()  # writes the trailer
        return self._take()

    def close(self) -> None:
        """Release the encoder without producing more output (for aborted streams). Safe to call twice."""
        if not self._finished:
            self._finished = True
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - best effort on abort
                pass


def _encoder(fmt: str, input_rate: int, sample_rate: int | None, out: BinaryIO | None) -> StreamEncoder:
    """A stream's encoder, or with `out` a whole file's, writing into `out` (seekable) as the bytes it returns are."""
    fmt = normalize_format(fmt)
    rate = output_sample_rate(fmt, sample_rate, input_rate)
    if fmt not in UNCOMPRESSED:
        return AvStreamEncoder(fmt, input_rate, rate, out=out)
    if UNCOMPRESSED[fmt][1]:
        return WavStreamEncoder(fmt, input_rate, rate, out)
    return RawStreamEncoder(fmt, input_rate, rate)


def create_stream_encoder(fmt: str, input_rate: int = SAMPLE_RATE, sample_rate: int | None = None) -> StreamEncoder:
    """A fresh :class:`StreamEncoder` for one streamed response in `fmt` at `sample_rate` (None: the format's
    default, :func:`output_sample_rate`); ValueError for an unknown format or a rate the format cannot carry."""
    return _encoder(fmt, input_rate, sample_rate, out=None)


class AudioFileWriter:
    """One whole `fmt` file written into the seekable `out` as its audio comes, chunk by chunk: the bytes
    encode_audio gives for the audio joined, never holding the audio (a narration's file can spool to disk). Like a
    StreamEncoder: one caller at a time; `close` after a failure."""

    def __init__(self, out: BinaryIO, fmt: str, input_rate: int = SAMPLE_RATE, sample_rate: int | None = None) -> None:
        self.out = out
        self._encoder = _encoder(fmt, input_rate, sample_rate, out=out)
        out.write(self._encoder.start())

    def write(self, samples: np.ndarray) -> None:
        self.out.write(self._encoder.encode(samples))

    def finish(self) -> None:
        self.out.write(self._encoder.finish())

    def close(self) -> None:
        self._encoder.close()


# --------------------------------------------------------------------------------------------------------------------
# whole files


def encode_audio(samples: np.ndarray, input_rate: int, fmt: str, sample_rate: int | None = None) -> bytes:
    """Encode a whole clip of float32 mono `samples` at `input_rate` Hz as one `fmt` file at `sample_rate` (None:
    the format's default), through the stream encoder a streamed response uses, in one chunk.

    Raises ValueError for an unknown format, a rate the format cannot carry, non-1-D input or empty audio.
    """
    x = check_samples(samples)
    if x.size == 0:
        raise ValueError("cannot encode empty audio")
    out = io.BytesIO()
    writer = AudioFileWriter(out, fmt, input_rate, sample_rate)
    try:
        writer.write(x)
        writer.finish()
    except BaseException:
        writer.close()
        raise
    return out.getvalue()
