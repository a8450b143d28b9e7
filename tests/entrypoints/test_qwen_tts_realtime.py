"""Qwen-TTS Realtime (DashScope) on WS /api-ws/v1/realtime, driven by the `dashscope` SDK's QwenTtsRealtime,
unmodified, pointed at the server by its `url` alone: commit and server_commit modes, cancel_response and finish; each
response's audio equals /v1/audio/speech's for its text; a cancelled response leaves nothing admitted or running
and the next is exact; bad input gets DashScope's error event and a clean close. Plus the text buffer's rules."""
import asyncio
import base64
import json
import threading

import aiohttp
import dashscope
import pytest
from dashscope.audio.qwen_tts_realtime import QwenTtsRealtime, QwenTtsRealtimeCallback

from audio_util import assert_same_audio
from omni_tts.entrypoints.api.dashscope.qwen_text_buffer import MAX_BUFFERED_CHARS, TextBuffer
from omni_tts.entrypoints.api.schema import MAX_TEXT_CHARS, ApiError
from server_util import MODEL, request
from waiting import eventually, eventually_async

GREEDY = {"temperature": 0.0, "max_new_tokens": 48}   # our sampling fields, passed through update_session's kwargs
TEXT = "Hello there, this is one turn."
REALTIME_MODEL = "qwen3-tts-flash-realtime"
RESPONSE_EVENTS = ["response.created", "response.output_item.added", "response.content_part.added",
                   "response.audio.delta", "response.audio.done", "response.content_part.done",
                   "response.output_item.done", "response.done"]


class Events(QwenTtsRealtimeCallback):
    """What the SDK hands its callback, from its own thread."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.close_code = None
        self.closed = threading.Event()

    def on_event(self, message: dict) -> None:
        self.events.append(message)

    def on_close(self, code, message) -> None:
        self.close_code = code
        self.closed.set()

    def types(self) -> list[str]:
        """The event types in order, a response's run of deltas as one."""
        types = [event["type"] for event in self.events]
        return [t for i, t in enumerate(types) if t != "response.audio.delta" or types[i - 1] != t]

    def of(self, type_: str) -> list[dict]:
        return [event for event in self.events if event["type"] == type_]

    def audio(self) -> list[bytes]:
        """Each response's audio, its deltas decoded, in the order the responses were created."""
        ids = [event["response"]["id"] for event in self.of("response.created")]
        return [b"".join(base64.b64decode(event["delta"]) for event in self.of("response.audio.delta")
                         if event["response_id"] == id_) for id_ in ids]


def connect(url: str, monkeypatch) -> tuple[QwenTtsRealtime, Events]:
    monkeypatch.setattr(dashscope, "api_key", "any-key")   # the SDK needs one; the server takes any (no --api-key)
    events = Events()
    client = QwenTtsRealtime(model=REALTIME_MODEL, callback=events,
                             url=url.replace("http", "ws", 1) + "/api-ws/v1/realtime")
    client.connect()
    return client, events


def speech_pcm(url: str, text: str, model: str = MODEL) -> bytes:
    status, _, body = request(url + "/v1/audio/speech", dict(GREEDY, model=model, input=text, voice="vivian",
                                                             response_format="pcm", non_streaming_mode=False))
    assert status == 200, body
    return body


def finished(events: Events) -> None:
    eventually(events.closed.is_set, what="the server's close after session.finished")
    assert events.types()[-1] == "session.finished" and events.close_code == 1000


def test_commit_mode_speaks_each_commit_as_one_response_equal_to_the_speech_route(cv_server, monkeypatch):
    client, events = connect(cv_server.url, monkeypatch)
    client.update_session(voice="vivian", mode="commit", **GREEDY)
    client.append_text("Hello there, ")
    client.append_text("this is one turn.")
    client.commit()
    client.append_text("Second turn.")
    client.commit()
    client.finish()
    finished(events)
    types = events.types()
    assert types[:3] == ["session.created", "session.updated", "input_text_buffer.committed"]
    assert [t for t in types[3:-1] if t != "input_text_buffer.committed"] == RESPONSE_EVENTS * 2
    assert types.count("input_text_buffer.committed") == 2
    assert events.of("session.created")[0]["session"]["model"] == REALTIME_MODEL
    assert events.of("session.updated")[0]["session"]["mode"] == "commit"
    assert [done["response"]["status"] for done in events.of("response.done")] == ["completed"] * 2
    assert [done["response"]["usage"]["characters"] for done in events.of("response.done")] == [len(TEXT), 12]
    first, second = events.audio()
    assert_same_audio(first, speech_pcm(cv_server.url, TEXT))
    assert_same_audio(second, speech_pcm(cv_server.url, "Second turn."))


def test_server_commit_streams_text_into_the_response_and_ends_it_at_the_sentence(cv_server, monkeypatch):
    client, events = connect(cv_server.url, monkeypatch)
    client.update_session(voice="vivian", mode="server_commit", volume=80, **GREEDY)
    client.append_text("Hello there, this is one turn")
    # the response speaks before any commit or sentence end
    eventually(lambda: events.of("response.audio.delta"), what="audio before the text's end")
    client.append_text(". Second one. ")   # its sentence end is known at once: nothing waits for the finish
    client.finish()
    finished(events)
    assert events.of("session.updated")[0]["session"]["ignored_fields"] == ["volume"]
    assert events.types()[2:-1] == RESPONSE_EVENTS * 2
    assert [done["response"]["usage"]["characters"] for done in events.of("response.done")] == [len(TEXT), 11]
    first, second = events.audio()
    assert_same_audio(first, speech_pcm(cv_server.url, TEXT))   # its text came in two pieces, a pause between
    assert_same_audio(second, speech_pcm(cv_server.url, "Second one."))


@pytest.mark.asyncio(loop_scope="session")
async def test_cancel_stops_the_response_frees_its_slot_and_the_next_is_exact(in_process_app, monkeypatch):
    url, state = in_process_app
    # the SDK blocks (its socket in a thread of its own): its calls run in threads while this loop serves
    client, events = await asyncio.to_thread(connect, url, monkeypatch)
    await asyncio.to_thread(client.update_session, voice="vivian", mode="server_commit", **GREEDY)
    await asyncio.to_thread(client.append_text, "Hello there, this is one turn")   # no end: it stays open
    await eventually_async(lambda: events.of("response.audio.delta"), what="the response's first audio")
    assert state.admitted == 1
    await asyncio.to_thread(client.cancel_response)
    await eventually_async(lambda: events.of("response.done"), what="the cancelled response's response.done")
    assert state.admitted == 0
    assert not state.tts.requests   # aborted in the stages, not only let go of here
    [done] = events.of("response.done")
    assert done["response"]["status"] == "incomplete"
    assert done["response"]["status_details"] == {"type": "incomplete", "reason": "cancelled"}
    await asyncio.to_thread(client.append_text, TEXT + " ")   # a whole sentence: the response's text at once
    await asyncio.to_thread(client.finish)
    await eventually_async(events.closed.is_set, what="the close after session.finished")
    assert events.types()[2:-1] == RESPONSE_EVENTS * 2   # the cancelled one's closing events, then the next's
    assert_same_audio(events.audio()[1], await asyncio.to_thread(speech_pcm, url, TEXT, "m"))
    assert state.admitted == 0


async def realtime_session(url: str, messages: list, wait_for_audio: bool = False,
                           model: str = "m") -> tuple[list[dict], int]:
    """Send `messages` (dicts as JSON, str and bytes as they are); the events after session.created until the
    server closes, and its close code. `wait_for_audio`: the last message waits for the first audio."""
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url.replace("http", "ws", 1) + f"/api-ws/v1/realtime?model={model}") as ws:
            assert (await ws.receive_json())["type"] == "session.created"
            for i, message in enumerate(messages):
                if wait_for_audio and i == len(messages) - 1:
                    while events[-1:] == [] or events[-1]["type"] != "response.audio.delta":
                        events.append(await ws.receive_json())
                if isinstance(message, bytes):
                    await ws.send_bytes(message)
                else:
                    await ws.send_str(message if isinstance(message, str) else json.dumps(message))
            async for message in ws:
                events.append(json.loads(message.data))
            return events, ws.close_code


@pytest.mark.asyncio(loop_scope="session")
async def test_clear_drops_the_buffer_and_deltas_are_in_the_sessions_format_and_rate(in_process_app):
    url, state = in_process_app
    update = {"type": "session.update", "session": dict(GREEDY, voice="vivian", mode="commit",
                                                        response_format="wav", sample_rate=16000)}
    events, close_code = await realtime_session(url, [
        update, {"type": "input_text_buffer.append", "text": "Never spoken."}, {"type": "input_text_buffer.clear"},
        {"type": "input_text_buffer.append", "text": TEXT}, {"type": "input_text_buffer.commit"},
        {"type": "session.finish"}])
    types = [event["type"] for event in events]
    assert types[:3] == ["session.updated", "input_text_buffer.cleared", "input_text_buffer.committed"]
    assert types[-1] == "session.finished" and close_code == 1000
    assert events[0]["session"] | {"response_format": "wav", "sample_rate": 16000} == events[0]["session"]
    wav = b"".join(base64.b64decode(event["delta"]) for event in events if event["type"] == "response.audio.delta")
    async with aiohttp.ClientSession() as http:
        body = dict(GREEDY, model="m", input=TEXT, voice="vivian", response_format="wav", sample_rate=16000,
                    stream_format="audio", non_streaming_mode=False)
        async with http.post(url + "/v1/audio/speech", json=body) as response:
            expected = await response.read()
    assert wav[:44] == expected[:44]   # one streamed WAV: its header first, then 16 kHz samples
    assert_same_audio(wav[44:], expected[44:])
    assert state.admitted == 0


UPDATE = {"type": "session.update", "session": dict(GREEDY, voice="vivian", mode="commit")}
BAD_INPUT = {
    "unknown event type": ([{"type": "response.create"}], "unknown event type 'response.create'"),
    # our own WebSocket's barge-in means nothing here (client_messages.py reads it only where asked to)
    "our input.cancel": ([{"type": "input.cancel"}], "unknown event type 'input.cancel'"),
    "malformed JSON": (["{not json"], "not valid JSON"),
    "too large": ([json.dumps({"type": "input_text_buffer.append", "text": "a" * 70_000})], "event too large"),
    "binary frame": ([b"\x00\x01"], "JSON text frames"),
    "empty commit": ([UPDATE, {"type": "input_text_buffer.commit"}], "buffer is empty"),
    "update once started": ([{"type": "input_text_buffer.append", "text": "Hi"}, UPDATE], "already started"),
    "unknown voice": ([{"type": "session.update", "session": {"voice": "nobody"}}], "unknown voice 'nobody'"),
    "unknown language": ([{"type": "session.update", "session": {"language_type": "Klingon"}}],
                         "unsupported language_type 'Klingon'"),
    "opus at 22050 Hz": ([{"type": "session.update", "session": {"response_format": "opus", "sample_rate": 22050}}],
                         "22050"),
}


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("case", BAD_INPUT)
async def test_bad_input_gets_the_error_event_and_a_clean_close(in_process_app, case):
    url, state = in_process_app
    messages, message = BAD_INPUT[case]
    events, close_code = await realtime_session(url, messages)
    error = events[-1]
    assert error["type"] == "error" and error["error"]["code"] == "invalid_value", events
    assert message in error["error"]["message"]
    assert close_code == 1000
    assert state.admitted == 0 and not state.tts.requests


@pytest.mark.asyncio(loop_scope="session")
async def test_bad_input_mid_response_stops_it(in_process_app):
    url, state = in_process_app
    update = {"type": "session.update", "session": dict(GREEDY, voice="vivian")}
    events, close_code = await realtime_session(url, [update, {"type": "input_text_buffer.append", "text": TEXT},
                                                      {"type": "nope"}], wait_for_audio=True)
    assert events[-1]["type"] == "error" and close_code == 1000
    assert state.admitted == 0 and not state.tts.requests   # stopped before the close


@pytest.mark.asyncio(loop_scope="session")
async def test_an_idle_session_is_closed(in_process_app, monkeypatch):
    url, state = in_process_app
    monkeypatch.setattr(state.config, "stream_idle_timeout", 0.2)
    events, close_code = await realtime_session(url, [])
    assert events[-1]["type"] == "error" and "no event for 0.2 s" in events[-1]["error"]["message"]
    assert close_code == 1000


@pytest.mark.asyncio(loop_scope="session")
async def test_a_dashscope_voice_and_model_name_are_accepted_and_an_unknown_model_is_refused(in_process_app):
    """Names DashScope's clients hard-code map through the alias table (api/names.py): Cherry, and the model in the
    URL; a model that is no alias is the protocol's error naming what is served."""
    url, _ = in_process_app
    events, _ = await realtime_session(url, [{"type": "session.update", "session": {"voice": "Cherry"}},
                                             {"type": "session.finish"}], model="qwen3-tts-flash-realtime")
    assert [event["type"] for event in events] == ["session.updated", "session.finished"]
    events, close_code = await realtime_session(url, [{"type": "session.update", "session": {"voice": "Cherry"}}],
                                                model="sambert-zhichu-v1")
    assert events[-1]["type"] == "error" and "sambert-zhichu-v1" in events[-1]["error"]["message"], events
    assert close_code == 1000


COMMIT = None


def spoken(buffer: TextBuffer, pieces: list[str | None]) -> list[str]:
    """The responses `pieces` (COMMIT: a commit) make, each taking the buffer's text as a session's would."""
    responses, current = [], ""
    for piece in pieces:
        if piece is COMMIT:
            buffer.commit(accepting=bool(current))
        else:
            buffer.append(piece)
        while (taken := buffer.take(current)) is not None:
            current += taken[0]
            if not taken[1]:
                break
            responses.append(current)
            current = ""
    return responses + ([current] if current else [])


def test_server_commit_ends_a_response_at_its_first_sentence():
    assert spoken(TextBuffer("server_commit"), ["  Hello", " there. How", " are", " you? Fine"]) == [
        "Hello there.", "How are you?", "Fine"]
    # the mark arrived in one piece, the space that decides it in the next
    assert spoken(TextBuffer("server_commit"), ["Hello.", " Next"]) == ["Hello.", "Next"]
    assert spoken(TextBuffer("server_commit"), ["Dr.", " Smith is here"]) == ["Dr. Smith is here"]
    # a commit ends the text so far; committed text ends a response at each sentence too
    assert spoken(TextBuffer("server_commit"), ["One", COMMIT, "Two. Three. ", "Four", COMMIT, "Five"]) == [
        "One", "Two.", "Three.", "Four", "Five"]


def test_server_commit_cuts_a_response_without_sentence_end_at_its_length_limit():
    words = "word " * (MAX_TEXT_CHARS // 5 + 10)
    [first, rest] = spoken(TextBuffer("server_commit"), [words])
    assert len(first) <= MAX_TEXT_CHARS and first + " " + rest == words   # cut at a space


def test_commit_mode_holds_text_until_a_commit_and_refuses_an_empty_one():
    buffer = TextBuffer("commit")
    buffer.append("Hello. World")
    assert buffer.take("") is None and not buffer.has_next()
    with pytest.raises(ApiError, match="empty"):
        TextBuffer("commit").commit(accepting=False)
    buffer.commit(accepting=False)
    assert buffer.take("") == ("Hello. World", True)


def test_waiting_text_is_bounded():
    buffer = TextBuffer("server_commit")
    for _ in range(MAX_BUFFERED_CHARS // 1000):
        buffer.append("a" * 1000)
    with pytest.raises(ApiError, match="would wait"):
        buffer.append("a" * 1000)
