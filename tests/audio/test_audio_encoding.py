"""Response-format encoding (whole files and streams) and pitch-preserving speed change."""

import io
import struct
import wave

import av
import numpy as np
import pytest
import soundfile as sf

from omni_tts.audio.encoding import content_type, create_stream_encoder, encode_audio
from omni_tts.audio.pcm import FORMATS, StreamEncoder, to_int16, wav_header
from omni_tts.audio.speed import change_speed

SR = 24000
LOSSY = ("mp3", "opus", "aac")
# Samples a decoder may add or drop, in output-rate samples: one codec frame, plus the priming ADTS AAC cannot
# signal (1024) and, for streamed MP3 (no Xing/LAME header), LAME's encoder delay (576 + 529).
FRAME = {"mp3": 1152, "opus": 960, "aac": 1024, "flac": 4608}
EXTRA = {"aac": 1024}
STREAM_EXTRA = {"aac": 1024, "mp3": 1105}


def sine(freq=440.0, seconds=1.3, sr=SR, amp=0.5):
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def speechlike(seconds=1.0, sr=SR, seed=0):
    """A sine plus noise and an amplitude envelope: not a pure steady state."""
    rng = np.random.default_rng(seed)
    x = sine(220.0, seconds, sr, 0.4) + 0.05 * rng.standard_normal(int(round(seconds * sr))).astype(np.float32)
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * np.arange(x.size) / sr)
    return (x * env).astype(np.float32)


def dominant_hz(y, sr):
    y = np.asarray(y, dtype=np.float64)
    spec = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    return np.argmax(spec) * sr / y.size


def av_decode(data: bytes):
    """Decode with FFmpeg (PyAV): (samples in the decoder's dtype, float or int16 for FLAC; sample rate)."""
    with av.open(io.BytesIO(data)) as c:
        rate = c.streams.audio[0].sample_rate
        frames = [f.to_ndarray() for f in c.decode(audio=0)]
    if not frames:
        return np.zeros(0, np.float32), rate
    return np.concatenate([f.reshape(-1) for f in frames]), rate  # mono: (1, n) packed or planar


def chunks_of(x, sizes):
    out, i, k = [], 0, 0
    while i < x.size:
        n = sizes[k % len(sizes)]
        out.append(x[i:i + n])
        i += n
        k += 1
    return out


def stream(fmt, x, sizes=(1920, 1, 0, 4800, 48000), sr=SR):
    enc = create_stream_encoder(fmt, sr)
    assert isinstance(enc, StreamEncoder)
    parts = [enc.start()]
    for c in chunks_of(x, list(sizes)):
        parts.append(enc.encode(c))
    parts.append(enc.finish())
    return parts


# --------------------------------------------------------------------------------------------------------------------
# formats, conversion


def test_formats_and_content_types():
    assert FORMATS == ("mp3", "opus", "aac", "flac", "wav", "pcm", "ulaw", "alaw", "ulaw_wav", "alaw_wav")
    assert [content_type(f) for f in FORMATS] == [
        "audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/pcm", "audio/basic",
        "audio/x-alaw-basic", "audio/wav", "audio/wav"]
    assert content_type("MP3") == "audio/mpeg"


@pytest.mark.parametrize("call", [
    lambda: content_type("ogg"),
    lambda: encode_audio(sine(), SR, "vorbis"),
    lambda: create_stream_encoder("m4a"),
    lambda: encode_audio(sine(), SR, None),
])
def test_bad_format_raises(call):
    with pytest.raises(ValueError, match="unsupported audio format .*mp3, opus, aac, flac, wav, pcm, ulaw, alaw, ulaw_wav, alaw_wav"):
        call()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="empty audio"):
        encode_audio(np.zeros(0, np.float32), SR, "wav")
    with pytest.raises(ValueError, match="empty audio"):
        encode_audio(np.zeros(0, np.float32), SR, "mp3")
    with pytest.raises(ValueError, match="1-D"):
        encode_audio(np.zeros((2, 100), np.float32), SR, "pcm")
    with pytest.raises(ValueError, match="sample_rate"):
        encode_audio(sine(), 0, "wav")


def test_to_int16():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 1e-5, 0.5, 1.0, 3.0, np.nan, 2e-5], np.float32)
    assert to_int16(x).dtype == np.int16
    assert to_int16(x).tolist() == [-32767, -32767, -16384, 0, 0, 16384, 32767, 32767, 0, 1]


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac"])
def test_nan_and_inf_become_silence_and_full_scale_in_every_16_bit_output(fmt):
    """Whole files and streams alike go through to_int16: a NaN sample is 0, never an undefined int16."""
    x = np.full(4800, 0.25, np.float32)
    x[[10, 20, 30]] = [np.nan, np.inf, -np.inf]
    expected = to_int16(x)
    assert expected[[10, 20, 30]].tolist() == [0, 32767, -32767]
    encoder = create_stream_encoder(fmt, SR)
    streamed = encoder.start() + encoder.encode(x) + encoder.finish()
    for data in (encode_audio(x, SR, fmt), streamed):
        if fmt == "pcm":
            got = np.frombuffer(data, "<i2")
        elif fmt == "wav":
            got = np.frombuffer(data[44:], "<i2")
        else:
            with av.open(io.BytesIO(data)) as container:
                got = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
        assert np.array_equal(got, expected)


# --------------------------------------------------------------------------------------------------------------------
# whole files


def test_pcm_and_wav_exact():
    x = speechlike()
    ref = to_int16(x)
    pcm = encode_audio(x, SR, "pcm")
    assert np.array_equal(np.frombuffer(pcm, "<i2"), ref)

    wav = encode_audio(x, SR, "wav")
    assert len(wav) == 44 + 2 * x.size and wav[44:] == pcm
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, SR, x.size)
        assert w.readframes(x.size) == pcm
    y, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == SR and np.array_equal(y, ref)


def test_flac_exact():
    x = speechlike()
    data = encode_audio(x, SR, "flac")
    assert data[:4] == b"fLaC"
    y, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SR and np.array_equal(y, to_int16(x))


@pytest.mark.parametrize("fmt", LOSSY)
def test_lossy_roundtrip(fmt):
    x = sine(440.0)
    data = encode_audio(x, SR, fmt)
    y, rate = av_decode(data)
    expected = x.size * rate // SR
    assert abs(y.size - expected) <= FRAME[fmt] + EXTRA.get(fmt, 0), (y.size, expected)
    assert dominant_hz(y, rate) == pytest.approx(440.0, rel=0.02)
    assert np.sqrt(np.mean(y ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.2)
    if fmt != "aac":  # independent decoder (libsndfile: mpg123 / libopus); it does not read ADTS
        z, zrate = sf.read(io.BytesIO(data), dtype="float32")
        assert abs(z.size * SR / zrate - x.size) <= FRAME[fmt] and dominant_hz(z, zrate) == pytest.approx(440, rel=0.02)


@pytest.mark.parametrize("fmt,rate", [("opus", 16000), ("mp3", 44100), ("aac", 16000), ("flac", 8000)])
def test_other_input_rates(fmt, rate):
    """Input at another rate is encoded at that rate when the format takes it."""
    x = sine(300.0, 1.0, rate)
    y, out_rate = av_decode(encode_audio(x, rate, fmt))
    assert abs(y.size / out_rate - 1.0) <= (FRAME[fmt] + EXTRA.get(fmt, 0)) / min(out_rate, rate)
    assert dominant_hz(y, out_rate) == pytest.approx(300.0, rel=0.02)


# --------------------------------------------------------------------------------------------------------------------
# streaming


def test_stream_pcm_equals_whole():
    x = speechlike()
    parts = stream("pcm", x)
    assert parts[0] == b"" and parts[-1] == b""
    assert b"".join(parts) == encode_audio(x, SR, "pcm")


def test_stream_wav_header_and_body():
    x = speechlike()
    parts = stream("wav", x)
    header = parts[0]
    assert len(header) == 44 and header == wav_header(SR, None)
    riff, riff_size, wave_id, fmt_id = struct.unpack_from("<4sI4s4s", header)
    assert (riff, wave_id, fmt_id, header[36:40]) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert riff_size == 0xFFFFFFFF and struct.unpack_from("<I", header, 40)[0] == 0xFFFFFFFF
    body = b"".join(parts[1:])
    whole = encode_audio(x, SR, "wav")
    assert body == whole[44:] and header[:4] + header[8:40] == whole[:4] + whole[8:40]
    data = header + body
    with wave.open(io.BytesIO(data)) as w:  # parses up to the data; the unknown length reads to the end
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SR)
        assert w.readframes(10 * x.size) == body
    y, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SR and np.array_equal(y, to_int16(x))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_stream_compressed(fmt):
    x = sine(440.0, 2.0)
    parts = stream(fmt, x)
    data = b"".join(parts)
    # audio comes out while streaming, not only at finish
    assert sum(len(p) for p in parts[:-1]) > len(data) // 2
    y, rate = av_decode(data)
    expected = x.size * rate // SR
    assert 0 <= y.size - expected + FRAME[fmt] <= 2 * FRAME[fmt] + STREAM_EXTRA.get(fmt, 0), (y.size, expected)
    if fmt == "flac":
        assert y.dtype == np.int16 and np.array_equal(y, to_int16(x))
    else:
        assert dominant_hz(y, rate) == pytest.approx(440.0, rel=0.02)


def test_stream_first_chunk_is_released_early():
    """The first small chunk's audio goes out before the next chunk arrives (no whole-second Ogg pages)."""
    x = sine(440.0, 0.5)
    for fmt in ("mp3", "opus", "wav", "pcm"):
        enc = create_stream_encoder(fmt)
        head = enc.start()
        first = enc.encode(x[:4 * 1920])  # a 4-frame (320 ms) first chunk
        assert len(first) > 0, fmt
        enc.finish()
        if fmt in ("mp3", "opus", "wav"):
            assert len(head) > 0, fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_lifecycle(fmt):
    enc = create_stream_encoder(fmt)
    data = enc.finish()  # no audio at all: still a clean (header-only) stream, no exception
    assert isinstance(data, bytes)
    with pytest.raises(RuntimeError, match="finished"):
        enc.encode(sine())
    # encode without an explicit start() still emits the header first
    enc = create_stream_encoder(fmt)
    out = enc.encode(sine(seconds=0.2)) + enc.finish()
    if fmt == "wav":
        assert out[:4] == b"RIFF"


# --------------------------------------------------------------------------------------------------------------------
# speed


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_changes_duration_keeps_pitch(speed):
    x = sine(300.0, 2.0)
    y = change_speed(x, speed, SR)
    assert y.dtype == np.float32 and y.size == round(x.size / speed)
    assert dominant_hz(y, SR) == pytest.approx(300.0, rel=0.03)
    assert np.sqrt(np.mean(y[: y.size * 9 // 10] ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.15)


def test_speed_speechlike_and_one():
    x = speechlike(1.0)
    assert change_speed(x, 1.0) is x
    y = change_speed(x, 1.5)
    assert y.size == round(x.size / 1.5) and np.all(np.isfinite(y))
    assert change_speed(np.zeros(0, np.float32), 2.0).size == 0
    assert change_speed(x[:100], 0.5).size == 200  # shorter than one filter window: still the right length


@pytest.mark.parametrize("speed", [0.2, 4.5, 0.0, -1.0, float("nan"), float("inf"), "fast", None, True])
def test_bad_speed_raises(speed):
    with pytest.raises(ValueError, match="speed must be"):
        change_speed(sine(), speed)
