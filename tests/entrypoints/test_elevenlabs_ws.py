"""ElevenLabs' WebSockets (stream-input, multi-stream-input): the official SDK's convert_realtime unmodified behind a
local TLS endpoint, a raw multi-context client, greedy parity with /v1/audio/speech, character alignment, barge-in
and bad input."""
import asyncio
import base64
import contextlib
import functools
import subprocess
import threading

import aiohttp
import pytest
from elevenlabs.client import ElevenLabs
from elevenlabs.core.api_error import ApiError
from elevenlabs import realtime_tts
from elevenlabs.realtime_tts import text_chunker

from audio_util import assert_same_audio
from conftest import FIXTURES, RUNS_TO_ITS_LIMIT
from omni_tts.config import STAGE_CONFIG_DIR
from server_util import MODEL, ServerProcess
from waiting import eventually_async

ALIGNER = FIXTURES.parent / "qwen3_forced_aligner" / "tiny-forced-aligner"
KEY = "el-test-key"
TEXT_A = "Hello there, this is one turn. "
TEXT_B = "Another voice speaks now. "
PIECES = ["Hello there,", " this is", " one turn."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Flags the shared servers lack: the forced aligner (alignment), --api-key (the first message's key) and greedy
    sampling defaults with a short token limit in the stage config (ElevenLabs has no sampling fields: the SDK's
    audio equals /v1/audio/speech's through the server's defaults)."""
    yaml = tmp_path_factory.mktemp("config") / "stages.yaml"
    yaml.write_text((STAGE_CONFIG_DIR / "cpu_tiny.yaml").read_text().replace(
        "sampling: {}", "sampling: {temperature: 0.0, max_new_tokens: 48}"))
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--forced-aligner", str(ALIGNER), "--stage-config", str(yaml), "--api-key", KEY)
    yield server
    server.stop()


class TlsProxy:
    """wss:// on a loopback port, relayed to the server's plain port: the SDK's convert_realtime dials wss on its
    base URL's host and port whatever its scheme. A self-signed certificate for 127.0.0.1, made with openssl."""

    def __init__(self, target_port: int, directory) -> None:
        import ssl

        self.cert = directory / "cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout",
                        str(directory / "key.pem"), "-out", str(self.cert)], check=True, capture_output=True)
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(self.cert, directory / "key.pem")
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        started = self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context))
        self.listener, self.port = started, started.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _relay(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(reader, writer):
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    def close(self) -> None:
        async def stop() -> None:
            self.listener.close()
            relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def ws_url(url: str, route: str, query: str = "output_format=pcm_24000", voice: str = "vivian") -> str:
    return f"{url.replace('http', 'ws', 1)}/v1/text-to-speech/{voice}/{route}?{query}"


async def speech_audio(url: str, text: str, headers: dict | None = None, **fields) -> bytes:
    body = dict({"response_format": "pcm"}, **fields, input=text, voice="vivian", non_streaming_mode=False)
    async with aiohttp.ClientSession(headers=headers) as http, http.post(url + "/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def read_contexts(ws, finals: int) -> tuple[dict, list[dict]]:
    """Audio and alignments per context id until `finals` isFinal messages."""
    audio, alignments, seen = {}, {}, 0
    while seen < finals:
        message = await ws.receive_json()
        context = message.get("contextId")
        assert context == message.get("context_id")
        if message.get("isFinal"):
            seen += 1
            continue
        audio[context] = audio.get(context, b"") + base64.b64decode(message["audio"])
        if message["alignment"] is not None:
            assert message["normalizedAlignment"] == message["alignment"]
            alignments.setdefault(context, []).append(message["alignment"])
    return audio, alignments


def absolute_chars(alignments: list[dict]) -> list[tuple[str, int, int]]:
    """(character, start, end) in ms from the context's start, added up as clients do: each message's times from
    the end of the previous message's last character."""
    base, chars = 0, []
    for a in alignments:
        assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
        assert min(a["charStartTimesMs"]) >= 0 and min(a["charDurationsMs"]) >= 0
        chars += [(c, base + start, base + start + length)
                  for c, start, length in zip(a["chars"], a["charStartTimesMs"], a["charDurationsMs"])]
        base += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
    return chars


def check_alignment(alignments: list[dict], text: str, audio_ms: float) -> None:
    """The characters spell the text; their times never go back and stay within the audio."""
    chars = absolute_chars(alignments)
    assert "".join(c for c, _, _ in chars) == text
    times = [t for _, start, end in chars for t in (start, end)]
    assert times == sorted(times) and times[-1] <= audio_ms + 1


@pytest.mark.asyncio
async def test_stream_input_alignment_spells_the_text_within_the_audio(server):
    """stream-input with the key in its first message (no header): the audio, then each sentence's characters."""
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server.url, "stream-input")) as ws:
        await ws.send_json({"text": " ", "xi_api_key": KEY, "generation_config": {"chunk_length_schedule": [50]}})
        for piece in ["Hello there, ", "this is one turn. ", "And a second one. "]:
            await ws.send_json({"text": piece, "try_trigger_generation": True})
        await ws.send_json({"text": ""})
        audio, alignments = await read_contexts(ws, 1)
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000
    text = TEXT_A + "And a second one. "
    assert_same_audio(audio[None], await speech_audio(server.url, text, {"Authorization": f"Bearer {KEY}"}))
    check_alignment(alignments[None], text, len(audio[None]) / 2 / 24)


def test_the_sdk_convert_realtime_equals_the_speech_route(server, tmp_path, monkeypatch):
    """The SDK unmodified, by its base URL only: it dials wss (a local TLS endpoint, trusted through SSL_CERT_FILE),
    sends its init, text chunks and the empty text, and reads audio until the close (1000)."""
    proxy = TlsProxy(server.port, tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(proxy.cert))
    # the SDK waits 10 s for the upgrade's answer (websockets' open_timeout); through the relay on a loaded 2-core
    # machine it once came later (a CI run): the timeout is the test's, not the behaviour under test
    monkeypatch.setattr(realtime_tts, "connect", functools.partial(realtime_tts.connect, open_timeout=60))
    try:
        client = ElevenLabs(api_key=KEY, base_url=f"https://127.0.0.1:{proxy.port}")
        audio = b"".join(client.text_to_speech.convert_realtime(
            voice_id="vivian", text=iter(PIECES), output_format="pcm_24000"))
        with pytest.raises(ApiError) as refused:   # the error message, then a close the SDK raises on
            b"".join(client.text_to_speech.convert_realtime(voice_id="nobody", text=iter(PIECES)))
    finally:
        proxy.close()
    assert refused.value.status_code == 1008 and "nobody" in str(refused.value.body)
    text = "".join(text_chunker(iter(PIECES)))   # what the SDK sends: the pieces cut at punctuation, spaces added
    assert_same_audio(audio, asyncio.run(speech_audio(server.url, text, {"Authorization": f"Bearer {KEY}"})))


@pytest.mark.asyncio
async def test_two_interleaved_contexts(server):
    """multi-stream-input as Pipecat and LiveKit speak it: contexts initialized, their text interleaved, keep-alives
    (context-less too), flush, close_context after the flush (the audio ends first), close_socket; each context's
    audio is /v1/audio/speech's for its text (within one 16-bit step: assert_same_audio), its characters spell it."""
    headers = {"xi-api-key": KEY}
    query = ("output_format=pcm_24000&model_id=eleven_turbo_v2_5&inactivity_timeout=180&sync_alignment=true"
             "&auto_mode=true")
    async with aiohttp.ClientSession(headers=headers) as http, \
            http.ws_connect(ws_url(server.url, "multi-stream-input", query)) as ws:
        await ws.send_json({"text": " ", "context_id": "a", "voice_settings": {"stability": 0.5, "speed": 1.0}})
        await ws.send_json({"text": " ", "context_id": "b"})
        await ws.send_json({"text": "Hello there, ", "context_id": "a"})
        await ws.send_json({"text": "Another voice ", "context_id": "b"})
        await ws.send_json({"text": ""})                        # Pipecat's keep-alive without a context
        await ws.send_json({"text": "this is one turn. ", "context_id": "a", "flush": True})
        await ws.send_json({"text": "", "context_id": "b"})     # a context's keep-alive: no end of its text
        await ws.send_json({"text": "speaks now. ", "context_id": "b"})
        await ws.send_json({"context_id": "b", "flush": True})
        await ws.send_json({"context_id": "a", "close_context": True})
        await ws.send_json({"context_id": "b", "close_context": True})
        audio, alignments = await read_contexts(ws, 2)
        await ws.send_json({"close_socket": True})
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000
    for context, text in (("a", TEXT_A), ("b", TEXT_B)):
        assert_same_audio(audio[context], await speech_audio(server.url, text, {"Authorization": f"Bearer {KEY}"}))
        check_alignment(alignments[context], text, len(audio[context]) / 2 / 24)


@pytest.mark.asyncio
@pytest.mark.parametrize("route, first", [("stream-input", {"text": " ", "xi-api-key": "wrong"}),
                                          ("multi-stream-input", {"xi_api_key": "wrong"}),   # the key alone
                                          ("multi-stream-input", {"text": "Hello ", "context_id": "a"})])
async def test_the_first_message_without_the_key_is_refused(server, route, first):
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server.url, route)) as ws:
        await ws.send_json(first)
        error = await ws.receive_json()
        assert error["code"] == 401 and error["error"] == "invalid_api_key" and "message" in error
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1008


@pytest.mark.asyncio
async def test_the_key_alone_then_contexts(server):
    """Some clients send the key in a message of its own first, then their contexts; the authorization query
    parameter (and a browser's key subprotocol) opens a socket as the header does (here in G.711 mu-law, the
    telephony format: the speech route's audio)."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(ws_url(server.url, "multi-stream-input")) as ws:
            await ws.send_json({"xi_api_key": KEY})
            await ws.send_json({"text": TEXT_B, "context_id": "a", "flush": True})
            await ws.send_json({"context_id": "a", "close_context": True})
            audio, _ = await read_contexts(ws, 1)
            assert audio["a"]
        query = f"output_format=ulaw_8000&authorization=Bearer%20{KEY}"
        async with http.ws_connect(ws_url(server.url, "stream-input", query)) as ws:
            await ws.send_json({"text": " "})
            await ws.send_json({"text": TEXT_B})
            await ws.send_json({"text": ""})
            audio, _ = await read_contexts(ws, 1)
            assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000
        assert_same_audio(audio[None], await speech_audio(server.url, TEXT_B, {"Authorization": f"Bearer {KEY}"},
                                                         response_format="ulaw"), "ulaw")
        key_protocol = "omni-tts.bearer." + base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")
        async with http.ws_connect(ws_url(server.url, "stream-input"), protocols=("omni-tts", key_protocol)) as ws:
            assert ws.protocol == "omni-tts"   # a browser's way, as on every WebSocket route of ours
            await ws.send_json({"text": " "})
            await ws.send_json({"text": ""})
            assert (await ws.receive_json()) == {"isFinal": True}
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:   # a wrong key presented: no socket
            await http.ws_connect(ws_url(server.url, "stream-input"), headers={"xi-api-key": "wrong"})
        assert refused.value.status == 401


@pytest.mark.asyncio(loop_scope="session")
async def test_close_context_mid_generation_stops_it_and_the_next_context_is_whole(in_process_app):
    """Barge-in: close_context on a context still taking text cuts it at once (isFinal, its slot free, no request
    left in the stages); the next context on the socket speaks as /v1/audio/speech does (assert_same_audio)."""
    url, state = in_process_app
    query = "output_format=pcm_24000&seed=11"   # a seed whose TEXT_B ends early (sampled: the shared server's defaults)
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(url, "multi-stream-input", query)) as ws:
        await ws.send_json({"text": " ", "context_id": "a"})
        await ws.send_json({"text": RUNS_TO_ITS_LIMIT + " ", "context_id": "a"})   # never flushed
        first = await ws.receive_json()
        assert first["contextId"] == "a" and first["audio"]
        await ws.send_json({"context_id": "a", "close_context": True})
        while not (message := await ws.receive_json()).get("isFinal"):
            assert message["contextId"] == "a"   # what was on its way before the close
        assert message["contextId"] == "a"
        assert state.admitted == 0 and not state.tts.requests
        await ws.send_json({"text": TEXT_B, "context_id": "b", "flush": True})
        await ws.send_json({"context_id": "b", "close_context": True})
        audio, _ = await read_contexts(ws, 1)
        await ws.send_json({"close_socket": True})
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000
    assert_same_audio(audio["b"], await speech_audio(url, TEXT_B, seed=11))
    assert state.admitted == 0


BAD_INPUT = [  # (route, whether a turn is speaking first, the messages, status, close code)
    ("stream-input", False, [{"text": "Hello "}], 400, 1008),                    # text before the init
    ("stream-input", True, ["{not json"], 400, 1008),
    ("stream-input", True, [{"text": "Hi ", "speak": True}], 400, 1008),         # an unknown field
    ("multi-stream-input", True, [{"context_id": "a"}], 400, 1008),              # no message the protocol has
    ("stream-input", True, [b"\x00\x01"], 415, 1003),                           # a binary frame
    ("multi-stream-input", True, [{"type": "input.cancel"}], 400, 1008),         # our WebSocket's, not this
    ("multi-stream-input", True, [{"text": "x" * 200_000, "context_id": "a"}], 413, 1009),
    ("multi-stream-input", True, [{"text": "Hi ", "context_id": c} for c in "abcde"], 400, 1008),   # a sixth
]
STARTS = {"stream-input": [{"text": " "}, {"text": RUNS_TO_ITS_LIMIT + " "}],
          "multi-stream-input": [{"text": RUNS_TO_ITS_LIMIT + " ", "context_id": "z"}]}


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("route, speaking, messages, status, close_code", BAD_INPUT, ids=[
    "text-before-init", "malformed-json", "unknown-field", "no-message", "binary-frame", "input-cancel", "oversize",
    "sixth-context"])
async def test_bad_input_is_an_error_then_a_close_and_nothing_runs(in_process_app, route, speaking, messages, status,
                                                                   close_code):
    """With a turn speaking when the bad message arrives: the error message, the close, and the turn's request is
    gone, its slot free."""
    url, state = in_process_app
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(url, route, "seed=1")) as ws:
        if speaking:
            for message in STARTS[route]:
                await ws.send_json(message)
            assert (await ws.receive_json())["audio"]
        for message in messages:
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            elif isinstance(message, str):
                await ws.send_str(message)
            else:
                await ws.send_json(message)
        error = await ws.receive_json()
        while "audio" in error:   # the turn's audio on its way
            error = await ws.receive_json()
        assert error["code"] == status and error["message"] and error["error"]
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == close_code
    await eventually_async(lambda: state.admitted == 0 and not state.tts.requests, what="the turn let go of")


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("query, voice, param", [("output_format=pcm_32000", "vivian", "output_format"),
                                                 ("output_format=flac_24000", "vivian", "output_format"),
                                                 ("inactivity_timeout=999", "vivian", "inactivity_timeout"),
                                                 ("output_format=pcm_24000", "nobody", "voice_id"),
                                                 ("seed=-5", "vivian", "seed"),
                                                 ("language_code=xx", "vivian", "language_code"),
                                                 ("model_id=eleven_nonexistent", "vivian", "model_id")])
async def test_bad_parameters_are_named(in_process_app, query, voice, param):
    """Each as ElevenLabs names it; a language the model lacks is found when its first text is read."""
    url, state = in_process_app
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(url, "stream-input", query, voice)) as ws:
        await ws.send_json({"text": " "})
        if param == "language_code":
            await ws.send_json({"text": "Hi "})
        error = await ws.receive_json()
        assert error["code"] == (404 if param == "model_id" else 400) and error["param"] == param, error
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1008
    await eventually_async(lambda: state.admitted == 0 and not state.tts.requests, what="nothing left")


@pytest.mark.asyncio(loop_scope="session")
async def test_an_idle_socket_is_closed_after_its_inactivity_timeout(in_process_app):
    url, state = in_process_app
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(ws_url(url, "multi-stream-input", "inactivity_timeout=0.2")) as ws:
        await ws.send_json({"text": " ", "context_id": "a"})
        error = await ws.receive_json()   # nothing more is sent
        assert error["code"] == 408 and "inactivity_timeout" in error["message"]
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1008


@pytest.mark.asyncio
async def test_a_contexts_pronunciation_dictionaries(server):
    """A context's init names an uploaded dictionary (TTS → text to speech): its audio is the replacement's, spoken
    plainly, its characters spell the text sent; a context without it on the same socket speaks the text as written."""
    rules = ElevenLabs(api_key=KEY, base_url=server.url).pronunciation_dictionaries.create_from_rules(
        name="acronyms", rules=[{"type": "alias", "string_to_replace": "TTS", "alias": "text to speech"}])
    locators = [{"pronunciation_dictionary_id": rules.id}]
    text, headers = "TTS is here. ", {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers={"xi-api-key": KEY}) as http, \
            http.ws_connect(ws_url(server.url, "multi-stream-input")) as ws:
        await ws.send_json({"text": " ", "context_id": "a", "pronunciation_dictionary_locators": locators})
        await ws.send_json({"text": text, "context_id": "a", "flush": True})
        await ws.send_json({"text": text, "context_id": "b", "flush": True})
        for context in "ab":
            await ws.send_json({"context_id": context, "close_context": True})
        audio, alignments = await read_contexts(ws, 2)
    assert_same_audio(audio["a"], await speech_audio(server.url, "text to speech is here. ", headers))
    assert_same_audio(audio["a"], await speech_audio(server.url, text, headers,
                                                      pronunciation_dictionary_locators=locators))
    check_alignment(alignments["a"], text, len(audio["a"]) / 2 / 24)
    assert_same_audio(audio["b"], await speech_audio(server.url, text, headers))


@pytest.mark.asyncio
async def test_text_after_a_flush_is_spoken_after_it(server):
    """A flush ends the text being spoken; the text after it is the context's next, its audio following (each
    /v1/audio/speech's for its own text), the characters of both in order, times going on from the first's."""
    second, headers = "And a second one. ", {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers={"xi-api-key": KEY}) as http, \
            http.ws_connect(ws_url(server.url, "multi-stream-input")) as ws:
        await ws.send_json({"text": TEXT_A, "context_id": "a", "flush": True})
        await ws.send_json({"text": second, "context_id": "a"})
        await ws.send_json({"context_id": "a", "flush": True})
        await ws.send_json({"context_id": "a", "close_context": True})
        audio, alignments = await read_contexts(ws, 1)
    first = await speech_audio(server.url, TEXT_A, headers)
    assert_same_audio(audio["a"], first + await speech_audio(server.url, second, headers))
    check_alignment(alignments["a"], TEXT_A + second, len(audio["a"]) / 2 / 24)
    first_ms, chars = len(first) / 2 / 24, absolute_chars(alignments["a"])
    assert chars[len(TEXT_A) - 1][2] <= first_ms + 1 <= chars[len(TEXT_A)][1] + 2   # the second's after the first
