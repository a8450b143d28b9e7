"""Bounds at the door, against the real server on loopback: every engine limit and numeric range is a 400 naming
the field before anything runs, oversized or slow bodies are 413 / 408, bad bytes (deep nesting, NaN) are 400
without a traceback or a held event loop, and /metrics counts every outcome and survives concurrent scrapes."""
import asyncio
import http.client
import json
import socket
import time

import aiohttp

import pytest

from conftest import FIXTURES
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import (_CONTROL_ROWS, PromptBuilder, PromptLimits, RequestError,
                                              SynthesisRequest, embed_prompt)
from server_util import ServerProcess
from test_server import MODEL, REF_TEXT, REF_WAV, _metric, request

OK = dict(model=MODEL, input="Hello.", voice="ryan", response_format="pcm", temperature=0, max_new_tokens=24)
CJK = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4000))  # distinct ideographs: a token or more each
BODY_READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--body-read-timeout", str(BODY_READ_TIMEOUT))
    yield server
    server.stop()


def speech(server, payload=None, data=None):
    body = data if data is not None else json.dumps(payload).encode()
    status, headers, answer = request(server.url + "/v1/audio/speech", data=body,
                                      headers={"Content-Type": "application/json"})
    return status, headers, answer


def error_of(answer):
    error = json.loads(answer)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


TOO_LONG_FOR_THE_TALKER = [
    ("instructions beyond max_model_len", dict(OK, instructions=CJK), "instructions"),
]


@pytest.mark.parametrize("name,payload,param", TOO_LONG_FOR_THE_TALKER, ids=[c[0] for c in TOO_LONG_FOR_THE_TALKER])
def test_text_beyond_the_talkers_limits_is_400_naming_the_field(server, name, payload, param):
    status, _, answer = speech(server, payload)
    error = error_of(answer)
    assert status == 400 and error["param"] == param, (status, error)
    assert "limit" in error["message"] or "max_model_len" in error["message"]


@pytest.mark.parametrize("text", [CJK, "a" + "\u0301" * 4095], ids=["4000 CJK characters", "4096 combining marks"])
def test_an_input_beyond_one_request_is_narrated_within_the_talkers_limits(server, text):
    status, headers, answer = speech(server, dict(OK, input=text, response_format="json", max_new_tokens=3))
    assert status == 200, answer[:300]
    segments = json.loads(answer)["segments"]
    assert len(segments) > 1 and "".join(s["text"] for s in segments) == text


def test_the_limits_are_the_talkers_own_bounds_exactly():
    """The row bound equals the non-streaming prompt's length, and each limit admits what fits to the token."""
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"), with_decoder=False)
    request = SynthesisRequest(text="Hello there.", voice="ryan", language="english", instructions="Calm.",
                               non_streaming_mode=True)
    prompt = tts.prompts.tokenize(request)
    rows = embed_prompt(tts.talker, tts.config, prompt)[0].shape[0]
    assert rows == len(prompt.instruct_ids) + len(prompt.text_ids) + _CONTROL_ROWS
    text_tokens = len(prompt.text_ids)
    PromptBuilder(tts.config, tts.prompts.tokenizer, PromptLimits(text_tokens, rows + 1)).tokenize(request)
    for limits, param in ((PromptLimits(text_tokens - 1, rows + 1), "input"),
                          (PromptLimits(text_tokens, rows), "instructions")):
        with pytest.raises(RequestError) as error:
            PromptBuilder(tts.config, tts.prompts.tokenizer, limits).tokenize(request)
        assert error.value.param == param


def test_text_within_the_limits_is_served(server):
    status, headers, _ = speech(server, dict(OK, input="word " * 400, instructions="Calm. " * 50))
    assert status == 200 and headers["x-omni-tts-finish-reason"] in ("stop", "length")


NUMERIC = [
    ("top_k", 2 ** 64), ("top_k", 2 ** 31), ("subtalker_top_k", 2 ** 64), ("seed", 2 ** 63), ("seed", -1),
    ("temperature", 101), ("subtalker_temperature", -0.5), ("top_p", 1.5), ("subtalker_top_p", 0),
    ("repetition_penalty", 101), ("max_new_tokens", 1), ("max_new_tokens", 8193), ("speed", 0),
    ("initial_codec_chunk_frames", 65),
]


@pytest.mark.parametrize("field,value", NUMERIC, ids=[f"{f}={v}" for f, v in NUMERIC])
def test_numeric_fields_out_of_range_are_400_naming_the_field(server, field, value):
    status, _, answer = speech(server, dict(OK, **{field: value}))
    assert status == 400 and error_of(answer)["param"] == field, (status, answer[:300])


def test_infinite_float_is_400(server):
    status, _, answer = speech(server, data=json.dumps(OK).encode()[:-1] + b', "temperature": 1e999}')
    assert status == 400 and error_of(answer)["param"] == "temperature"


@pytest.mark.parametrize("data,message", [
    (b'{"model": "qwen3-tts", "input": "\xff\xfe", "voice": "ryan"}', "not valid UTF-8"),
    (b'[1, 2, 3]', "must be a JSON object"),
    (b'"hello"', "must be a JSON object"),
], ids=["invalid utf-8", "array", "string"])
def test_undecodable_bodies_are_400(server, data, message):
    status, _, answer = speech(server, data=data)
    assert status == 400 and message in error_of(answer)["message"]


NESTED = "[" * 1000 + "]" * 1000   # 2 KB


def test_a_deeply_nested_body_is_a_400_on_every_route(server):
    """msgspec reads nested arrays on the thread's stack: 1,000 deep was a RecursionError, a 500 with a traceback on
    both HTTP routes, and "internal error" on the WebSocket."""
    logged = len(server.output())
    body = json.dumps(OK)[:-1] + f', "instructions": {NESTED}}}'
    for route in ("/v1/audio/speech", "/v1/audio/speech/batch"):
        status, _, answer = speech(server, data=body.encode()) if route.endswith("speech") else request(
            server.url + route, data=body.encode(), headers={"Content-Type": "application/json"})
        assert status == 400 and "nested too deeply" in error_of(answer)["message"], (route, status, answer[:300])

    async def session_config() -> dict:
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "/v1/audio/speech/stream") as ws:
            await ws.send_str(f'{{"type": "session.config", "voice": {NESTED}}}')
            return await ws.receive_json(timeout=30)
    assert asyncio.run(session_config()) == {
        "type": "error", "message": "the message is nested too deeply (arrays and objects within each other)"}
    assert "Traceback" not in server.output()[logged:]


def test_large_bodies_with_nan_are_refused_without_holding_the_event_loop(cv_server):
    """A body that is not JSON is refused by what msgspec read, NaN or Infinity named by its field, never parsed
    again by Python's json on the event loop: that held the loop ~2 s per 32 MB body, /health waiting 4.9 s beside
    four. A held loop shows only in time: four bodies of 30 MB of floats ending in NaN, arriving whole together, and
    /health asked at once must not wait as long as twice the time this process takes to parse one of them with
    Python's json (what the loop did for each: it waited more than four times that)."""
    hostile = (json.dumps(OK)[:-1] + ', "speaker_embedding": [' + "0.12345678901234567, " * 1_450_000
               + "NaN]}").encode()
    started = time.perf_counter()
    json.loads(hostile)   # Python's reader takes NaN
    parse = time.perf_counter() - started
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(hostile)}\r\n\r\n").encode()
    senders = [socket.create_connection(("127.0.0.1", cv_server.port), timeout=120) for _ in range(4)]
    try:
        for sender in senders:
            sender.sendall(head + hostile[:-1])
        for sender in senders:   # every body complete at once: the server refuses all four together
            sender.sendall(hostile[-1:])
        waits = []
        for _ in range(10):
            asked = time.perf_counter()
            assert request(cv_server.url + "/health")[0] == 200
            waits.append(time.perf_counter() - asked)
        for sender in senders:
            answer = http.client.HTTPResponse(sender)
            answer.begin()
            assert answer.status == 400 and error_of(answer.read())["param"] == "speaker_embedding"
    finally:
        for sender in senders:
            sender.close()
    assert max(waits) < 2 * parse, (waits, parse)


def test_names_are_bounded(server):
    status, _, answer = speech(server, dict(OK, voice="v" * 100_000))
    error = error_of(answer)
    assert status == 400 and error["param"] == "voice" and len(answer) < 1000


def _raw_response(port, head: bytes, chunks=(), pause=0.0, timeout=60.0) -> tuple[bytes, int]:
    """Send `head` then each chunk (pausing between them) on a raw socket; the status line and how many of the
    chunks went out before it came."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for sent, chunk in enumerate(chunks):
            try:
                s.sendall(chunk)
            except OSError:  # the server answered and closed
                break
            s.settimeout(pause)
            try:
                answer = s.recv(65536)
                if answer:
                    return answer.split(b"\r\n", 1)[0], sent + 1
            except TimeoutError:
                pass
        s.settimeout(timeout)
        return s.recv(65536).split(b"\r\n", 1)[0], len(chunks)


def test_slow_body_is_408_within_the_timeout(server):
    """A byte every 0.2 s never leaves a read idle, and the body never completes: a 408 while it still trickles
    (here for 20 s) is the whole body's deadline."""
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\": ")
    before = _metric(server, 'omni_tts_requests_total{status="408"}')
    status, sent = _raw_response(server.port, head, [b" "] * 100, pause=0.2)
    assert status.startswith(b"HTTP/1.1 408 ") and sent < 100, (status, sent)
    assert _metric(server, 'omni_tts_requests_total{status="408"}') == before + 1
    assert request(server.url + "/health")[0] == 200


def test_bodies_over_the_limit_are_413_declared_or_chunked(server):
    declared = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 40000000\r\n\r\n{")
    assert _raw_response(server.port, declared)[0].startswith(b"HTTP/1.1 413 ")
    chunked = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    megabyte = b"100000\r\n" + b" " * 0x100000 + b"\r\n"
    assert _raw_response(server.port, chunked, [megabyte] * 40, pause=0.01)[0].startswith(b"HTTP/1.1 413 ")


def test_requests_total_counts_every_response(server):
    outcomes = {"400": [b"{nope", b"\xff", b"[]", json.dumps(dict(OK, top_k=2 ** 64)).encode()],
                "404": [json.dumps(dict(OK, model="whisper-1")).encode()],
                "200": [json.dumps(OK).encode(), json.dumps(dict(OK, colour="blue")).encode()]}  # ignored
    before = {status: _metric(server, f'omni_tts_requests_total{{status="{status}"}}') for status in outcomes}
    for status, bodies in outcomes.items():
        for body in bodies:
            assert speech(server, data=body)[0] == int(status)
    after = {status: _metric(server, f'omni_tts_requests_total{{status="{status}"}}') for status in outcomes}
    assert {s: after[s] - before[s] for s in outcomes} == {s: len(b) for s, b in outcomes.items()}


def test_frame_budget_ends_with_length_and_is_counted(server):
    finished = 'omni_tts_requests_finished_total{finish_reason="length"}'
    before = _metric(server, finished)
    status, headers, body = speech(server, dict(OK, max_new_tokens=4))
    assert status == 200 and headers["x-omni-tts-finish-reason"] == "length"
    assert headers["x-omni-tts-output-tokens"] == "3" and len(body) == 3 * 1920 * 2  # N tokens → N − 1 frames
    assert _metric(server, finished) == before + 1


def test_ref_text_beyond_the_talkers_limit_is_400(base_server):
    clone = dict(model=MODEL, input="Clone me.", ref_audio=str(REF_WAV), response_format="pcm", temperature=0,
                 max_new_tokens=8)
    # within the character cap (1024), beyond the talker's 512 tokens: an emoji is several byte-level tokens
    status, _, answer = speech(base_server, dict(clone, ref_text="\N{PARROT}" * 600))
    error = error_of(answer)
    assert status == 400 and error["param"] == "ref_text" and "limit" in error["message"], (status, error)
    status, _, answer = speech(base_server, dict(clone, ref_text="x" * 1025))  # the cap uploads have too
    assert status == 400 and error_of(answer)["param"] == "ref_text" and "1024" in error_of(answer)["message"]
    # 6 MB: refused by the character cap (its message), before any tokenizing (whose message names the limit)
    status, _, answer = speech(base_server, dict(clone, ref_text="word " * 1_200_000))
    assert status == 400 and error_of(answer)["param"] == "ref_text" and "1024" in error_of(answer)["message"]
    assert speech(base_server, dict(clone, ref_text=REF_TEXT))[0] == 200
