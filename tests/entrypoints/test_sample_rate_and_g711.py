"""`sample_rate` and the G.711 formats over real sockets, against a real server on the tiny CustomVoice checkpoint
(greedy): every format at every rate it takes, streamed == whole; the samples equal soxr's one-shot resampling of
the server's own 24 kHz audio; ulaw / alaw decode with FFmpeg to that audio at 8 kHz within G.711's error; WAV
headers; SSE and WebSocket streams carry the same bytes; bad rates and formats are one-line 400s naming the field."""
import asyncio
import base64
import json
import struct

import aiohttp
import numpy as np
import pytest
import soxr

from audio_util import G711, decode, g711_bound, g711_decode
from omni_tts.audio.encoding import content_type, sample_rates
from omni_tts.audio.pcm import FORMATS, to_int16
import server_util
from server_util import MODEL, ServerProcess, request

SPEECH = {"model": MODEL, "voice": "ryan", "input": "Telephony at every rate.", "temperature": 0,
          "max_new_tokens": 24}
MP3_STREAM_DELAY = 1105  # LAME's encoder delay: only a whole file's Xing/LAME header lets a decoder skip it
# The server resamples its float audio before the int16 rounding; the test resamples the rounded 24 kHz pcm: the
# two differ by the filtered rounding error: one least significant bit, measured; a wrong filter, hundreds.
RESAMPLED_LSB = 2


def speak(server: ServerProcess, **fields) -> tuple[int, dict, bytes]:
    return request(server.url + "/v1/audio/speech", dict(SPEECH, **fields))


def ok(server: ServerProcess, **fields) -> tuple[bytes, str]:
    status, headers, body = speak(server, **fields)
    assert status == 200, body[:300]
    return body, headers["Content-Type"]


@pytest.fixture(scope="module")
def model_audio(cv_server) -> np.ndarray:
    """The server's 24 kHz audio for SPEECH, as float: what every other rate is made from."""
    pcm, _ = ok(cv_server, response_format="pcm")
    assert len(pcm) > 24000  # over half a second of audio: the resampler's edges are a small part of it
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32767


def resampled(model_audio: np.ndarray, rate: int) -> np.ndarray:
    """soxr's one-shot resampling of the server's 24 kHz audio, as int16."""
    return to_int16(soxr.resample(model_audio, 24000, rate) if rate != 24000 else model_audio).astype(np.int64)


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    assert np.abs(got.astype(np.int64) - expected).max() <= RESAMPLED_LSB


@pytest.mark.parametrize("fmt,rate", [(f, r) for f in FORMATS for r in sample_rates(f)])
def test_every_format_at_every_rate_streamed_equals_whole(cv_server, model_audio, fmt, rate):
    whole, whole_type = ok(cv_server, response_format=fmt, sample_rate=rate)
    stream, stream_type = ok(cv_server, response_format=fmt, sample_rate=rate, stream_format="audio")
    assert whole_type == stream_type == content_type(fmt)
    expected = resampled(model_audio, rate)
    if fmt in ("pcm", "ulaw", "alaw"):
        assert stream == whole
        if fmt == "pcm":
            assert_close(np.frombuffer(whole, "<i2"), expected)
        else:
            decoded = g711_decode(fmt, whole).astype(np.int64)
            assert decoded.size == expected.size
            assert np.all(np.abs(decoded - expected) <= g711_bound(expected) + RESAMPLED_LSB)
    elif fmt in ("wav", "ulaw_wav", "alaw_wav"):
        coding, size = ("pcm", 44) if fmt == "wav" else (fmt.removesuffix("_wav"), 58)
        assert stream[size:] == whole[size:]
        width = 2 if coding == "pcm" else 1
        tag, channels, header_rate, byte_rate, block_align, bits = struct.unpack_from("<HHIIHH", whole, 20)
        assert (tag, channels, header_rate, byte_rate, block_align, bits) == (
            1 if coding == "pcm" else G711[coding][1], 1, rate, rate * width, width, 8 * width)
        assert stream[:20] + stream[size - 8:size - 4] == whole[:4] + b"\xff" * 4 + whole[8:20] + b"data"
        assert stream[20:size - 8] == whole[20:size - 8].replace(struct.pack("<I", expected.size), b"\xff" * 4)
        assert stream[size - 4:size] == b"\xff" * 4  # streamed: every size unknown
        riff_size, data_size = struct.unpack_from("<I", whole, 4)[0], struct.unpack_from("<I", whole, size - 4)[0]
        assert riff_size == len(whole) - 8 and data_size == len(whole) - size == expected.size * width
        got, got_rate = decode(whole)
        assert got_rate == rate
        if coding == "pcm":
            assert_close(got, expected)
        else:
            assert np.array_equal(got, g711_decode(coding, whole[size:]))
    else:  # a codec: the same packets, so the same decoded audio (streamed MP3 keeps LAME's delay in front)
        got_whole, rate_whole = decode(whole)
        got_stream, rate_stream = decode(stream)
        offset = MP3_STREAM_DELAY if fmt == "mp3" else 0
        assert got_whole.size > 0 and np.array_equal(got_stream[offset:offset + got_whole.size], got_whole)
        assert rate_whole == rate_stream == (48000 if fmt == "opus" else rate)  # Ogg Opus decodes at 48 kHz
        if fmt == "opus":  # OpusHead's input sample rate: the rate it was encoded at
            assert struct.unpack_from("<I", whole, whole.index(b"OpusHead") + 12)[0] == rate
        if fmt == "flac":
            assert_close(got_whole, expected)


def test_the_default_rates(cv_server, model_audio):
    """No sample_rate: the model's 24 kHz, and G.711's only rate, 8 kHz."""
    pcm, _ = ok(cv_server, response_format="pcm")
    assert len(pcm) == 2 * model_audio.size
    ulaw, ctype = ok(cv_server, response_format="ulaw")
    assert ctype == "audio/basic" and ulaw == ok(cv_server, response_format="ulaw", sample_rate=8000)[0]
    wav, _ = ok(cv_server, response_format="alaw_wav")
    assert struct.unpack_from("<HHI", wav, 20) == (6, 1, 8000)


@pytest.mark.parametrize("fmt,rate", [("pcm", 16000), ("ulaw", 8000), ("alaw_wav", 8000), ("mp3", 44100)])
def test_sse_deltas_are_the_streamed_bytes(cv_server, fmt, rate):
    stream, _ = ok(cv_server, response_format=fmt, sample_rate=rate, stream_format="audio")
    body, ctype = ok(cv_server, response_format=fmt, sample_rate=rate, stream_format="sse")
    assert ctype.startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and all(e["response_format"] == fmt for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == stream
    assert events[-1]["type"] == "speech.audio.done"


def test_a_stream_arrives_in_chunks_of_the_whole_files_bytes(cv_server):
    """G.711 streams with the same chunking as pcm: the first chunk comes before the last audio is made."""
    whole, _ = ok(cv_server, response_format="ulaw")

    async def main() -> list[bytes]:
        async with aiohttp.ClientSession() as http:
            async with http.post(cv_server.url + "/v1/audio/speech",
                                 json=dict(SPEECH, response_format="ulaw", stream_format="audio")) as response:
                assert response.status == 200
                return [data async for data, _ in response.content.iter_chunks()]

    chunks = asyncio.run(main())
    assert len([c for c in chunks if c]) > 1 and b"".join(chunks) == whole


def ws_utterance(server: ServerProcess, **config) -> tuple[list[dict], bytes]:
    """One WebSocket utterance (the text whole, one request): its JSON events and binary audio."""
    audio, events = asyncio.run(server_util.ws_utterance(server.url, [
        dict({k: v for k, v in SPEECH.items() if k != "input"}, type="session.config", split_granularity="none",
             **config),
        {"type": "input.text", "text": SPEECH["input"]}, {"type": "input.done"}]))
    return events, audio


@pytest.mark.parametrize("stream_audio", [True, False])
def test_websocket_audio_at_a_sample_rate(cv_server, stream_audio):
    whole, _ = ok(cv_server, response_format="pcm", sample_rate=16000)
    events, audio = ws_utterance(cv_server, response_format="pcm", sample_rate=16000, stream_audio=stream_audio)
    start = next(e for e in events if e["type"] == "audio.start")
    assert start["sample_rate"] == 16000 and start["channels"] == 1
    assert audio == whole
    events, audio = ws_utterance(cv_server, response_format="ulaw", stream_audio=stream_audio)
    assert events[-1]["type"] == "session.done" and audio == ok(cv_server, response_format="ulaw")[0]


def test_a_rate_the_format_cannot_carry_ends_the_websocket_session(cv_server):
    events, audio = ws_utterance(cv_server, response_format="alaw", sample_rate=16000)
    assert audio == b"" and events[-1]["type"] == "error"
    assert events[-1]["message"] == "sample_rate 16000 is not available for alaw: expected 8000"


BAD = [
    ("unknown format", dict(response_format="ogg"), "response_format",
     "invalid 'response_format': Invalid enum value 'ogg'; expected one of mp3, opus, aac, flac, wav, pcm, ulaw, "
     "alaw, ulaw_wav, alaw_wav"),
    ("unknown rate", dict(sample_rate=12345), "sample_rate",
     "invalid 'sample_rate': Invalid enum value 12345; expected one of 8000, 16000, 22050, 24000, 44100, 48000"),
    ("rate as a string", dict(sample_rate="8000"), "sample_rate", "invalid 'sample_rate'"),
    ("ulaw at 16 kHz", dict(response_format="ulaw", sample_rate=16000), "sample_rate",
     "sample_rate 16000 is not available for ulaw: expected 8000"),
    ("alaw_wav at 24 kHz, streamed", dict(response_format="alaw_wav", sample_rate=24000, stream_format="audio"),
     "sample_rate", "sample_rate 24000 is not available for alaw_wav: expected 8000"),
    ("opus at 44.1 kHz", dict(response_format="opus", sample_rate=44100, stream_format="sse"), "sample_rate",
     "sample_rate 44100 is not available for opus: expected one of 8000, 16000, 24000, 48000"),
]


@pytest.mark.parametrize("name,fields,param,message", BAD, ids=[b[0] for b in BAD])
def test_bad_rates_and_formats_are_400s_naming_the_field(cv_server, name, fields, param, message):
    status, _, body = speak(cv_server, **fields)
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == param and error["code"] == "invalid_request"
    assert error["message"].startswith(message) and "\n" not in error["message"]
