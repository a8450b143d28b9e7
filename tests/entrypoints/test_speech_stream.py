"""WS /v1/audio/speech/stream over real sockets, against real server processes: token mode gives the whole text's
audio whatever the cuts and pauses, starts before the text ends, keeps concurrent sessions apart; sentence mode;
bad messages end the session with nothing left in the stages."""
import asyncio
import base64
import gc
import json
import random
import time
import types
import urllib.request

import aiohttp
import numpy as np
import pytest

from conftest import FIXTURES, RUNS_TO_ITS_LIMIT
from omni_tts.audio.pcm import to_int16
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from server_util import ServerProcess, unclosed_codec_containers
from waiting import eventually, eventually_async

MODEL = "qwen3-tts"
KEY = "stream-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE = 3.0
GREEDY = {"temperature": 0, "max_new_tokens": 48}
REF = {"ref_audio": str(FIXTURES / "ref_voice.wav"), "ref_text": (FIXTURES / "ref_voice.txt").read_text().strip()}
TEXT = ("Streaming text arrives word by word from a language model, and the speech starts long before the "
        "sentence is over. 42 is the answer!")


def serve(variant: str, *args: str) -> ServerProcess:
    return ServerProcess("--model", str(FIXTURES / variant), "--served-model-name", MODEL, "--api-key", KEY,
                         "--stream-idle-timeout", str(IDLE), "--allowed-local-media-path", str(FIXTURES), *args)


@pytest.fixture(scope="module")
def servers():
    """serve(variant) for each variant the module's tests ask for, started at the first ask (tiny-custom-voice with
    room for 40 requests), stopped at the module's end."""
    started: dict[str, ServerProcess] = {}

    def server(variant: str) -> ServerProcess:
        if variant not in started:
            started[variant] = serve(variant, *(["--max-queue", "40"] if variant == "tiny-custom-voice" else []))
        return started[variant]
    yield server
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def cv_server(servers):
    """This module's tiny-custom-voice server (with an API key: not conftest's)."""
    return servers("tiny-custom-voice")


def http_pcm(server: ServerProcess, text: str, **fields) -> np.ndarray:
    body = dict(GREEDY, model=MODEL, input=text, response_format="pcm", non_streaming_mode=False, **fields)
    req = urllib.request.Request(server.url + "/v1/audio/speech", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=120) as response:
        return np.frombuffer(response.read(), dtype="<i2")


def stage_requests(server: ServerProcess) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers=AUTH)
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("omni_tts_stage_requests", "omni_tts_in_flight")))


def wait_until_stages_hold_nothing(server: ServerProcess) -> None:
    eventually(lambda: stage_requests(server) == 0, what="the stages and admission holding nothing")


class Session:
    """A WebSocket client that reads every event while the test sends."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.events = ws, asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            data = json.loads(message.data) if message.type == aiohttp.WSMsgType.TEXT else message.data
            self.events.put_nowait(data)
        self.events.put_nowait(None)  # closed

    async def send(self, message: dict | str) -> None:
        await self.ws.send_str(message if isinstance(message, str) else json.dumps(message))

    async def utterance(self, pieces: list[str], delays: list[float]) -> dict:
        """Send one utterance's text and input.done; collect its events up to session.done."""
        for piece, delay in zip(pieces, delays):
            await asyncio.sleep(delay)
            await self.send({"type": "input.text", "text": piece})
        await self.send({"type": "input.done"})
        result = {"events": [], "pcm": b""}
        while True:
            event = await asyncio.wait_for(self.events.get(), 120)
            assert event is not None, result["events"]
            if isinstance(event, bytes):
                result["pcm"] += event
                continue
            result["events"].append(event)
            assert event["type"] != "error", event
            if event["type"] == "session.done":
                return result

    async def audio_flowing(self) -> None:
        """Until the utterance's first audio arrives (its request is running in the stages)."""
        while not isinstance(await asyncio.wait_for(self.events.get(), 60), bytes):
            pass

    async def closing_error(self) -> str:
        """The error event the server sends before it closes."""
        event = await asyncio.wait_for(self.events.get(), 30)
        while isinstance(event, bytes) or (event is not None and event["type"] != "error"):
            event = await asyncio.wait_for(self.events.get(), 30)
        assert event is not None, "closed without an error event"
        assert await asyncio.wait_for(self.events.get(), 30) is None and self.ws.closed
        return event["message"]


async def open_session(server: ServerProcess, http: aiohttp.ClientSession, **config) -> Session:
    ws = await http.ws_connect(server.url + "/v1/audio/speech/stream", headers=AUTH)
    session = Session(ws)
    if config:
        await session.send(dict({"type": "session.config", "response_format": "pcm"}, **config))
    return session


def mid_word_cuts(rng: random.Random, text: str, pause: float) -> tuple[list[str], list[float]]:
    """Pieces cut at random places (inside words too) with random delays, one pause long enough for rows to wait."""
    points = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    delays = [rng.choice([0.0, 0.0, 0.02, 0.1]) for _ in pieces]
    delays[rng.randrange(2, len(pieces))] = pause
    return pieces, delays


def assert_pcm_close(pcm: bytes, expected: np.ndarray) -> None:
    got = np.frombuffer(pcm, dtype="<i2")
    assert got.shape == expected.shape
    assert np.abs(got.astype(np.int32) - expected.astype(np.int32)).max() <= 1


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("variant,voice", [
    ("tiny-custom-voice", {"voice": "ryan"}),
    ("tiny-voice-design", {"instructions": "A calm, deep voice.", "language": "english"}),
    ("tiny-base", {**REF, "language": "english"}),
    ("tiny-base", {**REF, "x_vector_only_mode": True}),
], ids=["custom-voice", "voice-design", "base-icl", "base-x-vector"])
def test_token_mode_equals_the_whole_text(variant, voice, servers):
    server = servers(variant)
    # ICL: the prefill waits for as many text tokens as the reference has frames, so its text is longer
    text = TEXT + (" " + TEXT if "ref_text" in voice else "")
    expected = http_pcm(server, text, **voice)
    rng = random.Random(len(variant) + len(voice))

    async def main():
        async with aiohttp.ClientSession() as http:
            session = await open_session(server, http, stream_audio=True, **GREEDY, **voice)
            for pause in (1.2, 0.0):  # two utterances on one connection: one with a pause that makes rows wait
                result = await session.utterance(*mid_word_cuts(rng, text, pause))
                assert_pcm_close(result["pcm"], expected)
                starts = [e for e in result["events"] if e["type"] == "audio.start"]
                assert len(starts) == 1 and starts[0]["sample_rate"] == 24000 and starts[0]["channels"] == 1
                assert result["events"][-1]["total_sentences"] == 1
            await session.send({"type": "session.close"})
            await session.reader
    run(main())
    wait_until_stages_hold_nothing(server)


def test_first_audio_arrives_before_the_text_ends(cv_server):
    """Held by state: the rest of the text is sent only once audio has come, so audio that waited for the text's
    end would never come (the wait fails instead)."""
    words = (TEXT + " " + TEXT).split(" ")

    async def main():
        async with aiohttp.ClientSession() as http:
            session = await open_session(cv_server, http, voice="vivian", stream_audio=True, **GREEDY)
            await session.send({"type": "input.text", "text": " ".join(words[:12]) + " "})
            await session.audio_flowing()
            result = await session.utterance([" ".join(words[12:])], [0])
            assert result["events"][-1]["type"] == "session.done"
            await session.ws.close()
    run(main())


def test_16_sessions_and_16_http_requests_get_their_own_audio(cv_server):
    voices = ["ryan", "vivian", "serena", "aiden", "eric", "dylan", "sohee", "ono_anna"]
    texts = [f"Request {i}: {TEXT.split('.')[0]}." for i in range(16)]
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    expected = [to_int16(r.audio) for r in synthesize(tts, [
        SynthesisRequest(text=t, voice=voices[i % 8], non_streaming_mode=False,
                         sampling=SamplingParams(temperature=0, max_new_tokens=32)) for i, t in enumerate(texts)])]
    rng = random.Random(16)

    async def ws_one(http, i):
        session = await open_session(cv_server, http, voice=voices[i % 8], stream_audio=i % 2 == 0,
                                     temperature=0, max_new_tokens=32)
        pieces, delays = mid_word_cuts(rng, texts[i], 0.3)
        result = await session.utterance(pieces, delays)
        await session.ws.close()
        return result["pcm"]

    async def http_one(i):
        return await asyncio.to_thread(http_pcm, cv_server, texts[i], voice=voices[i % 8], temperature=0,
                                       max_new_tokens=32)

    async def main():
        async with aiohttp.ClientSession() as http:
            return await asyncio.gather(*(ws_one(http, i) for i in range(16)), *(http_one(i) for i in range(16)))
    results = run(main())
    for i in range(16):
        assert_pcm_close(results[i], expected[i])
        assert_pcm_close(results[16 + i].tobytes(), expected[i])
    wait_until_stages_hold_nothing(cv_server)


def test_sentence_mode_makes_a_request_per_sentence(cv_server):
    sentences = ["One sentence here.", "A second one!", "And is this the third?"]

    async def main():
        async with aiohttp.ClientSession() as http:
            session = await open_session(cv_server, http, voice="ryan", split_granularity="sentence",
                                         non_streaming_mode=False, **GREEDY)
            text = " ".join(sentences)
            result = await session.utterance([text[:9], text[9:30], text[30:]], [0, 0.05, 0.05])
            starts = [e for e in result["events"] if e["type"] == "audio.start"]
            assert [(s["sentence_index"], s["sentence_text"]) for s in starts] == list(enumerate(sentences))
            assert result["events"][-1] == {"type": "session.done", "utterance_index": 0, "total_sentences": 3}
            await session.ws.close()
            return result
    result = run(main())
    expected = np.concatenate([http_pcm(cv_server, s, voice="ryan") for s in sentences])
    assert_pcm_close(result["pcm"], expected)


BAD_MESSAGES = [
    ("bad json", None, "{nope", "the message is not valid JSON"),
    ("not an object", None, "[1, 2]", "must be a JSON object"),
    ("unknown type", {}, {"type": "audio.please"}, "invalid 'type'"),
    ("text before config", None, {"type": "input.text", "text": "Hi"}, "first message must be session.config"),
    ("text without text", {}, {"type": "input.text"}, "missing required field 'text'"),
    ("unknown field", {}, {"type": "input.text", "text": "Hi", "colour": "blue"}, "unknown field 'colour'"),
    ("oversize text", {}, {"type": "input.text", "text": "a" * (129 * 1024)}, "message too large"),
    ("oversize config", None, {"type": "session.config", "ref_text": "a" * (5 * 2**20)}, "message too large"),
    ("mid-utterance garbage", {"text": "Half a sentence, then"}, "{nope", "not valid JSON"),
    ("text over 4096 characters", {"text": "word " * 900}, None, "at most 4096 characters"),
    ("streamed speed", None, {"type": "session.config", "stream_audio": True, "speed": 2.0}, "speed must be 1.0"),
    ("token mode, non-streaming layout", {"non_streaming_mode": True, "text": "Hello there"}, None,
     "non_streaming_mode"),
]


@pytest.mark.parametrize("name,before,message,error", BAD_MESSAGES, ids=[b[0] for b in BAD_MESSAGES])
def test_bad_messages_end_the_session_cleanly(cv_server, name, before, message, error):
    async def main():
        async with aiohttp.ClientSession() as http:
            session = await open_session(cv_server, http)
            if before is not None:
                config = {k: v for k, v in before.items() if k != "text"}
                await session.send(dict({"type": "session.config", "voice": "ryan", "stream_audio": True}, **config))
                if "text" in before:
                    await session.send({"type": "input.text", "text": before["text"]})
                    if message is not None:  # it comes mid-utterance: while the text's request runs
                        await session.audio_flowing()
            if message is not None:
                await session.send(message)
            assert error in await session.closing_error()
    run(main())
    wait_until_stages_hold_nothing(cv_server)


def subprotocols(key: str, *others: str) -> tuple[str, ...]:
    """What a browser offers for the key (it cannot set Authorization on a WebSocket)."""
    return ("omni-tts", "omni-tts.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("="), *others)


async def key_as_subprotocol(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    """The key as a subprotocol opens a session, answered `omni-tts` (never the key); a wrong key, or the key
    protocol offered alone, is refused; elsewhere than the stream route the subprotocol is no key."""
    url = server.url + "/v1/audio/speech/stream"
    async with http.ws_connect(url, protocols=subprotocols(KEY)) as ws:
        assert ws.protocol == "omni-tts"
        session = Session(ws)
        await session.send({"type": "session.config", "voice": "ryan"})
        await session.send({"type": "session.close"})
        assert await asyncio.wait_for(session.events.get(), 30) is None  # closed by the server, no error
    for protocols in (subprotocols("wrong-key"), subprotocols(KEY)[1:]):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(url, protocols=protocols)
        assert refused.value.status == 401
    async with http.get(server.url + "/v1/models",
                        headers={"Sec-WebSocket-Protocol": ", ".join(subprotocols(KEY))}) as models:
        assert models.status == 401


def test_idle_sessions_admission_and_the_api_key():
    server = serve("tiny-custom-voice", "--max-queue", "1")
    try:
        async def main():
            async with aiohttp.ClientSession() as http:
                # a session that never configures (it takes no slot), running out its IDLE s beside the rest (the
                # config's 10 s, shortened to the idle timeout)
                quiet = await open_session(server, http)
                quiet_error = asyncio.create_task(quiet.closing_error())
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(server.url + "/v1/audio/speech/stream")
                assert refused.value.status == 401
                await key_as_subprotocol(server, http)
                async with http.get(server.url + "/v1/audio/speech/stream", headers=AUTH) as plain:
                    assert plain.status == 400 and set((await plain.json())["error"]) == {
                        "message", "type", "param", "code"}  # documented: no upgrade, the error envelope
                holder = await open_session(server, http, voice="ryan", stream_audio=True)
                await holder.send({"type": "input.text", "text": "This utterance holds the only slot"})
                last_message = time.monotonic()
                first = await asyncio.wait_for(holder.events.get(), 60)  # admitted and speaking
                assert first["type"] == "audio.start", first
                second = await open_session(server, http, voice="ryan")
                await second.send({"type": "input.text", "text": "Me too"})
                assert "at capacity" in await second.closing_error()
                # its text never ends: the session (no message) or the request (no text) times out, not earlier
                # (a lower bound only: a busy machine can make a timeout late, never early)
                assert f"for {IDLE:g} s" in await holder.closing_error()
                assert time.monotonic() - last_message > IDLE - 0.5
                assert f"no session.config within {IDLE:g} s" in await quiet_error
        run(main())
        wait_until_stages_hold_nothing(server)
    finally:
        server.stop()


def in_flight(server: ServerProcess) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers=AUTH)
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("omni_tts_in_flight "))


def talker_waiting_for_text(server: ServerProcess) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers=AUTH)
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("omni_tts_talker_waiting_for_text{"))


def test_a_config_with_reference_audio_is_admitted_before_its_audio_is_read():
    """A full server refuses a session.config whose ref_audio it would have to read and decode (429's message),
    as it refuses an HTTP request's; the slot is the config's only while that work runs."""
    server = serve("tiny-base", "--max-queue", "1", "--stream-idle-timeout", "60")
    try:
        async def main():
            async with aiohttp.ClientSession() as http:
                holder = await open_session(server, http, **REF)
                await holder.send({"type": "input.text", "text": "This utterance holds the only slot"})
                # its utterance's request in the talker, waiting for more text (in_flight alone would also count
                # the holder's own config, whose reference audio is read in a slot)
                await eventually_async(lambda: in_flight(server) == 1 and talker_waiting_for_text(server) == 1,
                                       what="the holder's utterance admitted")
                refused = await open_session(server, http, **REF)
                assert "at capacity" in await refused.closing_error()
                await holder.ws.close()
        run(main())
        wait_until_stages_hold_nothing(server)
    finally:
        server.stop()


def test_session_config_is_bounded_per_connection(cv_server):
    async def main():
        async with aiohttp.ClientSession() as http:
            session = await open_session(cv_server, http)
            for _ in range(17):
                await session.send({"type": "session.config", "voice": "ryan", "response_format": "pcm"})
            assert "at most 16 session.config messages" in await session.closing_error()
    run(main())


@pytest.mark.asyncio(loop_scope="session")
async def test_a_closed_token_utterance_leaves_the_stages_before_its_slot_is_freed(in_process_app):
    """Watched between the server's steps (the app runs in this loop): the slot is never free while the engine
    still holds the request."""
    url, state = in_process_app
    async with aiohttp.ClientSession() as http:
        session = await open_session(types.SimpleNamespace(url=url), http, voice="ryan")
        await session.send({"type": "input.text", "text": RUNS_TO_ITS_LIMIT})  # the text stays open
        await eventually_async(lambda: state.tts.requests, what="the utterance's request in the engine")
        assert state.admitted == 1
        await session.send({"type": "session.close"})

        def slot_freed() -> bool:  # looked at on every turn of the loop: never free while still held
            assert state.admitted or not state.tts.requests, "the slot was freed first"
            return not state.admitted
        await eventually_async(slot_freed, what="the slot freed", interval=0)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_streamed_utterance_the_client_leaves_closes_its_encoder(in_process_app):
    url, state = in_process_app
    gc.collect()
    gc.disable()  # what the GC would free late must still be there to be seen
    try:
        async with aiohttp.ClientSession() as http:
            session = await open_session(types.SimpleNamespace(url=url), http, voice="ryan",
                                         response_format="mp3", stream_audio=True, temperature=0)
            await session.send({"type": "input.text", "text": RUNS_TO_ITS_LIMIT})
            await session.audio_flowing()
            await session.ws.close()  # the client goes away mid-utterance
        await eventually_async(lambda: not state.admitted, what="the utterance's slot freed")
        assert unclosed_codec_containers() == []
    finally:
        gc.enable()


@pytest.mark.parametrize("granularity,in_flight", [("sentence", 1), ("none", 2)])   # none: the narration's window
@pytest.mark.asyncio(loop_scope="session")
async def test_a_client_close_mid_utterance_ends_it_at_once(in_process_app, granularity, in_flight):
    """sentence and none speak a sentence (a narration) before they handle the next message; the client's close must
    still end the utterance at once, as a dropped connection does. Watched between the server's steps: once the
    client closes, no request of the utterance starts, the running ones leave the stages and the slot is freed."""
    url, state = in_process_app
    text = " ".join([RUNS_TO_ITS_LIMIT] * 24)   # sentences (segments) that each run to the model's length limit
    async with aiohttp.ClientSession() as http:
        session = await open_session(types.SimpleNamespace(url=url), http, voice="ryan", temperature=0,
                                     stream_audio=True, split_granularity=granularity)
        await session.send({"type": "input.text", "text": text})
        await session.send({"type": "input.done"})
        await session.audio_flowing()
        await eventually_async(lambda: len(state.tts.requests) == in_flight, what="the utterance's requests running")
        running = set(state.tts.requests)
        assert state.admitted == 1
        closing = asyncio.create_task(session.ws.close())   # answered by the server's close frame as it ends

        def ended() -> bool:  # looked at on every turn of the loop
            assert set(state.tts.requests) <= running, "a request started after the client's close"
            return not (state.admitted or state.tts.requests)
        await eventually_async(ended, what="the utterance ended and its slot freed", interval=0)
        await closing
        assert session.ws.close_code == 1000
    assert all(not s.request_ids for s in (await state.tts.stats()).values())
