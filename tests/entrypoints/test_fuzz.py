"""Fuzz the real server with schemathesis, from the OpenAPI document it serves at /openapi.json.

Every documented operation gets generated valid and invalid requests (hypothesis, both generation modes). The
server must never answer 5xx or drop the connection, its answers must match the document (status codes, content
types, JSON bodies), and invalid requests must be refused with a 4xx. Findings are collected over the whole run
instead of stopping at the first, and the test fails listing each kind once, with a curl command to reproduce it.
The WebSocket route is documented as the GET it is before its upgrade: a plain request gets its 400. Its sessions
(which schemathesis cannot drive) get message sequences from hypothesis: every session must end with a close after at
most one error event, every event must match the document's SpeechStreamServerEvent, and no request may be left in
the stages.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from conftest import FIXTURES
from server_util import ServerProcess
from waiting import eventually

MODEL = "fuzz-model"
EXAMPLES_PER_MODE = 60  # per operation and generation mode: ~15 s per model on the shared 2-core machine
SYNTHESIZED_EXAMPLES = 15  # requests that make audio (up to ~15 s of it, mp3 by default): ~2 s each here
WS_EXAMPLES = 40  # WebSocket sessions per model; most end at their first bad message, the rest make short audio
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


# a voice each model can speak with: an uploaded one on the Base model, a built-in speaker on the other
VOICES = {"tiny-base": "fuzz-voice", "tiny-custom-voice": "ryan"}


@pytest.fixture(scope="module", params=sorted(VOICES))
def server(request, tmp_path_factory):
    """With --voices-dir, so the voices routes are live (uploads work on the Base model, are refused on the other)."""
    server = ServerProcess("--model", str(FIXTURES / request.param), "--served-model-name", MODEL,
                           "--voices-dir", str(tmp_path_factory.mktemp("voices")))
    if request.param == "tiny-base":
        with open(FIXTURES / "ref_voice.wav", "rb") as clip:
            upload = requests.post(server.url + "/v1/audio/voices", files={"audio_sample": clip},
                                   data={"name": VOICES["tiny-base"],
                                         "ref_text": (FIXTURES / "ref_voice.txt").read_text()})
        assert upload.status_code == 200, upload.text
    server.voice = VOICES[request.param]
    yield server
    server.stop()


@dataclass
class Finding:
    """One kind of failure (an operation, a check's verdict, the status): how often, and the first requests."""
    count: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)  # (curl command, response body)


class Findings(dict[tuple[str, str, str], Finding]):
    SHOWN = 3  # examples per kind

    def add(self, operation: str, problem: str, status: str, reproduction: str, response: str) -> None:
        finding = self.setdefault((operation, problem, status), Finding())
        finding.count += 1
        example = (reproduction, response[:300])
        if len(finding.examples) < self.SHOWN and example not in finding.examples:
            finding.examples.append(example)

    def summary(self, server_log: str) -> str:
        lines = [f"{len(self)} kind(s) of finding:"]
        for (operation, problem, status), finding in sorted(self.items()):
            lines.append(f"- {operation}: {problem} [{status}] ×{finding.count}")
            for reproduction, response in finding.examples:
                lines += [f"    request: {reproduction}", f"    response: {response}"]
        errors = "".join(line for line in server_log.splitlines(keepends=True) if " INFO " not in line)
        return "\n".join(lines) + "\nserver log (all but INFO), last 4000 characters:\n" + errors[-4000:]


def with_voice(voice: str) -> Callable[[Case], Case]:
    """Valid speech requests that name a voice the model has, so they get past voice resolution and synthesize
    (random names and ref_audio strings are refused before anything runs)."""
    def prepare(case: Case) -> Case:
        case.body.pop("ref_audio", None)
        case.body["voice"] = voice
        return case
    return prepare


def fuzz_operation(operation: APIOperation, mode: GenerationMode, session: requests.Session, findings: Findings,
                   prepare: Callable[[Case], Case] | None = None, examples: int = EXAMPLES_PER_MODE) -> None:
    cases = operation.as_strategy(generation_mode=mode)
    label = operation.label + (" (voice set)" if prepare else "")

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases.map(prepare) if prepare else cases)
    def run(case: Case) -> None:
        try:
            response = case.call(session=session, timeout=60)
        except requests.RequestException as e:  # a crash, a reset or a hang: no HTTP answer at all
            findings.add(label, f"no response ({type(e).__name__})", "-", case.as_curl_command(), str(e))
            return
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            for failure in group.exceptions:
                findings.add(label, failure.title, str(response.status_code), case.as_curl_command(),
                             response.content.decode("utf-8", "replace"))

    try:
        run()
    except Unsatisfiable:  # nothing invalid to send (GET /health takes no input; any string is a voice name)
        assert mode is GenerationMode.NEGATIVE


# in the default suite at a third of the examples (~25 s); --runslow runs them all (~75 s)
def test_fuzz_every_operation(server, pytestconfig):
    share = 1 if pytestconfig.getoption("--runslow") else 3
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=SchemathesisConfig())
    findings = Findings()
    operations = [result.ok() for result in schema.get_all_operations()]  # all but GET /openapi.json itself
    assert {"POST /v1/audio/speech", "POST /v1/audio/voices", "DELETE /v1/audio/voices/{name}"} <= {
        operation.label for operation in operations}
    with requests.Session() as session:
        for operation in operations:
            for mode in GenerationMode:
                fuzz_operation(operation, mode, session, findings, examples=EXAMPLES_PER_MODE // share)
            if operation.label == "POST /v1/audio/speech":
                fuzz_operation(operation, GenerationMode.POSITIVE, session, findings, with_voice(server.voice),
                               SYNTHESIZED_EXAMPLES // share)
    assert server.proc.poll() is None, "the server died"
    assert not findings, findings.summary(server.output())


# --- WS /v1/audio/speech/stream ---------------------------------------------------------------------------------
# schemathesis speaks HTTP only: the WebSocket route is fuzzed here with hypothesis, message sequences built from the
# protocol's own message types with fields valid, mistyped or out of range, plus frames that are no message at all
SCALARS = st.none() | st.booleans() | st.integers(-10, 10 ** 6) | st.floats(allow_nan=True) | st.text(max_size=12)
FORMATS = st.sampled_from(["pcm", "wav", "mp3", "flac", "opus", "aac"])


def ws_messages(voice: str) -> st.SearchStrategy:
    """Half the sessions are well formed (a config within range, text, done) with at most one bad message put
    somewhere; the rest are anything."""
    good_config = st.fixed_dictionaries({
        "type": st.just("session.config"), "voice": st.just(voice), "max_new_tokens": st.integers(2, 24),
        "response_format": FORMATS, "split_granularity": st.sampled_from(["token", "sentence", "clause", "none"]),
        "stream_audio": st.booleans(), "temperature": st.sampled_from([0, 0.7])}, optional={
        "speed": st.sampled_from([1.0, 1.5]), "language": st.sampled_from(["auto", "english"]),
        "initial_codec_chunk_frames": st.integers(1, 30), "seed": st.integers(0, 2 ** 63 - 1)})
    config = st.fixed_dictionaries({"type": st.just("session.config")}, optional={
        "voice": st.sampled_from([voice, "alloy", "nobody"]) | SCALARS,
        "model": st.sampled_from([MODEL, "tts-1", "other"]) | SCALARS,
        "response_format": FORMATS | SCALARS,
        "split_granularity": st.sampled_from(["token", "sentence", "clause", "none"]) | SCALARS,
        "stream_audio": st.booleans() | SCALARS,
        "temperature": st.sampled_from([0, 0.7]) | SCALARS,
        "max_new_tokens": st.integers(-2, 24) | SCALARS,
        "speed": st.sampled_from([1.0, 1.5]) | SCALARS,
        "language": st.sampled_from(["auto", "english", "klingon"]) | SCALARS,
        "initial_codec_chunk_frames": st.integers(-1, 30) | SCALARS,
        "unknown_field": SCALARS})
    good_text = st.fixed_dictionaries({"type": st.just("input.text"), "text": st.text(max_size=30)})
    text = st.fixed_dictionaries({"type": st.just("input.text"), "text": st.text(max_size=30) | SCALARS})
    bare = st.sampled_from([{"type": "input.done"}, {"type": "session.close"}, {"type": "no.such.type"}, {}])
    raw = st.text(max_size=20) | st.binary(max_size=20) | st.lists(SCALARS, max_size=3)
    anything = st.one_of(config, text, text, text, bare, raw)

    @st.composite
    def well_formed(draw: st.DrawFn) -> list:
        body = draw(st.lists(good_text, min_size=1, max_size=5)) + [{"type": "input.done"}]
        if draw(st.booleans()):  # a second utterance on the same connection
            body += draw(st.lists(good_text, min_size=1, max_size=3)) + [{"type": "input.done"}]
        messages = [draw(good_config)] + body
        if draw(st.booleans()):
            messages.insert(draw(st.integers(0, len(messages))), draw(anything))
        return messages
    return st.one_of(well_formed(), st.lists(anything, min_size=1, max_size=8))


async def ws_session(url: str, messages: list, event_schema: dict) -> list[str]:
    """Send `messages`, then read until the server closes (or goes quiet); returns what was wrong."""
    problems = []
    timeout = aiohttp.ClientWSTimeout(ws_receive=30)
    async with aiohttp.ClientSession() as http, http.ws_connect(url + "/v1/audio/speech/stream",
                                                              timeout=timeout) as ws:
        for message in messages:
            if ws.closed:
                break
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_str(message if isinstance(message, str) else json.dumps(message))
        if not ws.closed:
            await ws.send_json({"type": "input.done"})
            await ws.send_json({"type": "session.close"})
        errored = False
        while True:
            try:
                frame = await ws.receive()
            except TimeoutError:
                problems.append("no close within 30 s")
                break
            if frame.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                if ws.close_code not in (1000, 1008, 1009):
                    problems.append(f"close code {ws.close_code}")
                break
            if frame.type == aiohttp.WSMsgType.BINARY:
                continue
            if frame.type != aiohttp.WSMsgType.TEXT:
                problems.append(f"frame {frame.type!r}")
                break
            event = json.loads(frame.data)
            if errored:
                problems.append(f"an event after the error: {event}")
            errored = errored or event.get("type") == "error"
            if not jsonschema_rs.validator_for(event_schema).is_valid(event):
                problems.append(f"event outside the schema: {event}")
            elif event["type"] == "error" and "Traceback" in event["message"]:
                problems.append(f"a traceback in an error: {event['message'][:200]}")
    return problems


def test_fuzz_the_websocket_route(server):
    document = requests.get(server.url + "/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    event_schema = {**schemas["SpeechStreamServerEvent"], "$defs": {}}
    findings: list[tuple[list, list[str]]] = []

    @settings(max_examples=WS_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(messages=ws_messages(server.voice))
    def run(messages: list) -> None:
        problems = asyncio.run(ws_session(server.url, messages, event_schema))
        if problems and len(findings) < 5:
            findings.append((messages, problems))

    run()
    assert server.proc.poll() is None, "the server died"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    eventually(lambda: held(server) == 0, what="the sessions' requests gone from the stages and admission")
    assert not findings, "\n".join(f"{m!r}: {p}" for m, p in findings) + server.output()[-4000:]


def held(server: ServerProcess) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("omni_tts_stage_requests", "omni_tts_in_flight")))
