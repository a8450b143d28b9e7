"""Output sample rates (soxr, one resampler per stream) and G.711 mu-law / A-law, raw and in WAV: which rate goes with
which format, chunked == whole == soxr's one-shot resampling, streamed == whole for every format at every rate, and
G.711 bytes that FFmpeg's and libsndfile's decoders read back within the codec's quantisation error."""
import io
import struct

import numpy as np
import pytest
import soundfile as sf
import soxr

from omni_tts.audio.encoding import (content_type, create_stream_encoder, encode_audio, output_sample_rate,
                                     sample_rates)
from omni_tts.audio.g711 import alaw_bytes, ulaw_bytes
from omni_tts.audio.pcm import FORMATS, to_int16, wav_header
from omni_tts.audio.resample import SAMPLE_RATES, Resampler
from audio_util import G711, decode, g711_bound, g711_decode

SR = 24000
MP3_STREAM_DELAY = 1105  # LAME's encoder delay, which only a whole file's Xing/LAME header lets a decoder skip
ODD_CHUNKS = (1920, 1, 0, 4800, 777, 7680)


def speechlike(seconds=2.0, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    x = 0.4 * np.sin(2 * np.pi * 220 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (x + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def chunks(x, sizes=ODD_CHUNKS):
    i, k = 0, 0
    while i < x.size:
        n = sizes[k % len(sizes)]
        yield x[i:i + n]
        i, k = i + n, k + 1


def streamed(fmt, x, sample_rate=None):
    enc = create_stream_encoder(fmt, SR, sample_rate)
    return enc.start() + b"".join(enc.encode(c) for c in chunks(x)) + enc.finish()


# --------------------------------------------------------------------------------------------------------------------
# which rate


def test_sample_rates_per_format():
    for fmt in ("pcm", "wav", "flac", "mp3", "aac"):
        assert sample_rates(fmt) == SAMPLE_RATES == (8000, 16000, 22050, 24000, 44100, 48000)
    assert sample_rates("opus") == (8000, 16000, 24000, 48000)  # libopus' rates
    for fmt in ("ulaw", "alaw", "ulaw_wav", "alaw_wav"):
        assert sample_rates(fmt) == (8000,)
        assert output_sample_rate(fmt, None) == 8000
    assert output_sample_rate("mp3", None) == output_sample_rate("pcm", None) == SR
    assert output_sample_rate("wav", 44100) == 44100


@pytest.mark.parametrize("fmt,rate,message", [
    ("ulaw", 16000, "sample_rate 16000 is not available for ulaw: expected 8000"),
    ("alaw_wav", 24000, "sample_rate 24000 is not available for alaw_wav: expected 8000"),
    ("opus", 22050, "sample_rate 22050 is not available for opus: expected one of 8000, 16000, 24000, 48000"),
    ("wav", 12345, "expected one of 8000, 16000, 22050, 24000, 44100, 48000"),
])
def test_a_rate_the_format_cannot_carry_raises(fmt, rate, message):
    with pytest.raises(ValueError, match=message):
        output_sample_rate(fmt, rate)
    with pytest.raises(ValueError, match=message):
        create_stream_encoder(fmt, SR, rate)
    with pytest.raises(ValueError, match=message):
        encode_audio(speechlike(0.1), SR, fmt, rate)


# --------------------------------------------------------------------------------------------------------------------
# the resampler


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_chunked_resampling_equals_whole_and_one_shot(rate):
    x = speechlike()
    stream = Resampler(SR, rate)
    parts = [stream(c) for c in chunks(x)] + [stream.flush()]
    whole = Resampler(SR, rate)
    one = np.concatenate([whole(x), whole.flush()])
    assert np.array_equal(np.concatenate(parts), one)
    if rate == SR:
        assert np.array_equal(one, x)
    else:
        assert np.array_equal(one, soxr.resample(x, SR, rate))
    assert one.size == x.size * rate // SR


# --------------------------------------------------------------------------------------------------------------------
# every format at every rate: streamed == whole


@pytest.mark.parametrize("fmt,rate", [(f, r) for f in FORMATS for r in sample_rates(f)])
def test_streamed_equals_whole(fmt, rate):
    x = speechlike()
    whole, stream = encode_audio(x, SR, fmt, rate), streamed(fmt, x, rate)
    expected = to_int16(soxr.resample(x, SR, rate) if rate != SR else x)
    if fmt == "pcm":
        assert stream == whole and np.array_equal(np.frombuffer(whole, "<i2"), expected)
    elif fmt in ("ulaw", "alaw"):
        assert stream == whole and len(whole) == expected.size
        assert whole == (ulaw_bytes if fmt == "ulaw" else alaw_bytes)(expected)
    elif fmt in ("wav", "ulaw_wav", "alaw_wav"):
        coding, size = ("pcm", 44) if fmt == "wav" else (fmt.removesuffix("_wav"), 58)
        assert stream[size:] == whole[size:] and len(whole) == size + expected.size * (2 if coding == "pcm" else 1)
        assert stream[:size] == wav_header(rate, None, coding) and whole[:size] == wav_header(rate, expected.size,
                                                                                              coding)
    else:  # a codec: the same packets, so the same decoded samples (streamed MP3 keeps LAME's delay in front)
        got_whole, rate_whole = decode(whole)
        got_stream, rate_stream = decode(stream)
        offset = MP3_STREAM_DELAY if fmt == "mp3" else 0
        assert np.array_equal(got_stream[offset:offset + got_whole.size], got_whole)
        assert rate_whole == rate_stream == (48000 if fmt == "opus" else rate)
        if fmt == "opus":  # OpusHead's input sample rate: the rate it was encoded at
            assert struct.unpack_from("<I", whole, whole.index(b"OpusHead") + 12)[0] == rate
        if fmt == "flac":
            assert np.array_equal(got_whole, expected)


# --------------------------------------------------------------------------------------------------------------------
# G.711


def test_g711_known_codes():
    pcm16 = np.array([0, 32767, -32768, 1000, -1000], np.int16)
    assert list(ulaw_bytes(pcm16)) == [0xFF, 0x80, 0x00, 0xCE, 0x4E]
    assert list(alaw_bytes(pcm16)) == [0xD5, 0xAA, 0x2A, 0xFA, 0x7A]


@pytest.mark.parametrize("fmt", ["ulaw", "alaw"])
def test_every_16_bit_value_decodes_back_within_the_quantisation_error(fmt):
    every = np.arange(-32768, 32768, dtype=np.int16)
    decoded = g711_decode(fmt, (ulaw_bytes if fmt == "ulaw" else alaw_bytes)(every)).astype(np.int64)
    assert decoded.size == every.size
    assert np.all(np.diff(decoded) >= 0)  # monotone: a louder sample never decodes quieter
    assert np.all(np.abs(decoded - every) <= g711_bound(every))
    assert np.unique(decoded).size == (255 if fmt == "ulaw" else 256)  # mu-law's two zeros decode alike


@pytest.mark.parametrize("fmt", ["ulaw", "alaw"])
def test_g711_raw_and_wav_decode_to_the_8khz_signal(fmt):
    x = speechlike()
    reference = to_int16(soxr.resample(x, SR, 8000))
    raw = encode_audio(x, SR, fmt)
    assert content_type(fmt) == ("audio/basic" if fmt == "ulaw" else "audio/x-alaw-basic")
    decoded = g711_decode(fmt, raw)
    assert decoded.size == reference.size == x.size // 3
    assert np.all(np.abs(decoded.astype(np.int64) - reference) <= g711_bound(reference))
    wav = encode_audio(x, SR, fmt + "_wav")
    assert content_type(fmt + "_wav") == "audio/wav"
    riff, riff_size, wave, fmt_id, fmt_size = struct.unpack_from("<4sI4s4sI", wav)
    tag, channels, rate, byte_rate, block_align, bits, extension = struct.unpack_from("<HHIIHHH", wav, 20)
    fact, fact_size, fact_samples, data, data_size = struct.unpack_from("<4sII4sI", wav, 38)
    assert (riff, wave, fmt_id, fmt_size, fact, fact_size, data) == (b"RIFF", b"WAVE", b"fmt ", 18, b"fact", 4, b"data")
    assert (tag, channels, rate, byte_rate, block_align, bits, extension) == (G711[fmt][1], 1, 8000, 8000, 1, 8, 0)
    assert fact_samples == data_size == reference.size and riff_size == len(wav) - 8 and wav[58:] == raw
    for data in (wav, streamed(fmt + "_wav", x)):  # whole and streamed (sizes unknown), by FFmpeg and libsndfile
        got, rate = decode(data)
        assert rate == 8000 and np.array_equal(got, decoded)
        got, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == 8000 and np.array_equal(got, decoded)
        assert sf.info(io.BytesIO(data)).subtype == fmt.upper()
