"""WS /v1/realtime, spoken by the `openai` SDK unmodified (`AsyncOpenAI(base_url=…)`, `client.realtime.connect`): a
response reads its text as /v1/audio/speech does (pcm and pcmu audio equal, the transcript the text), in band and
out of band; instructions are a style with the "read verbatim" sentences dropped; response.cancel cuts the audio and
leaves nothing admitted or running, the next response exact; bad events get the error event and the session goes on,
but for an oversized one, which ends it cleanly."""
import base64
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from audio_util import assert_same_audio
from conftest import FIXTURES, RUNS_TO_ITS_LIMIT
from omni_tts.config.stage_config import load_stage_config
from omni_tts.entrypoints.api.app import build_app
from omni_tts.entrypoints.api.openai_realtime.connection import MAX_MESSAGE_BYTES
from omni_tts.entrypoints.api.server_config import ServerConfig
from omni_tts.orchestrator.async_tts import AsyncTTS
from waiting import eventually_async

GREEDY_SESSION = {"temperature": 0, "max_output_tokens": 48}   # temperature: this server's extension
GREEDY = {"temperature": 0.0, "max_new_tokens": 48}
TEXT = "Hello there, this is one turn."
RESPONSE_EVENTS = ["response.created", "response.output_item.added", "response.content_part.added",
                   "response.output_audio_transcript.delta", "response.output_audio.delta",
                   "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
                   "response.output_item.done", "response.done"]


async def speech(url: str, text: str, **fields) -> bytes:
    body = dict(GREEDY, model="m", input=text, voice="vivian", response_format="pcm", non_streaming_mode=False) | fields
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/audio/speech", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.read()


def connect(url: str):
    return AsyncOpenAI(base_url=url + "/v1", api_key="x").realtime.connect(model="gpt-realtime-2.1-mini")


async def configure(connection, **session) -> dict:
    created = await connection.recv()
    assert created.type == "session.created" and created.session.model == "gpt-realtime-2.1-mini"
    await connection.session.update(session={"type": "realtime", **GREEDY_SESSION, **session})
    updated = await connection.recv()
    assert updated.type == "session.updated", updated
    return updated.to_dict()["session"]


async def response(connection) -> tuple[list[str], bytes, dict]:
    """A response's event types (runs of audio deltas as one), its audio, and its events by type (the last)."""
    types, audio, events = [], b"", {}
    async for event in connection:
        if event.type == "response.output_audio.delta":
            audio += base64.b64decode(event.delta)
        if not (types and types[-1] == event.type == "response.output_audio.delta"):
            types.append(event.type)
        events[event.type] = event
        if event.type in ("response.done", "error"):
            return types, audio, events


def user_message(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@pytest.mark.asyncio(loop_scope="session")
async def test_an_in_band_response_reads_the_new_user_items_as_the_speech_route(in_process_app):
    url, state = in_process_app
    async with connect(url) as connection:
        tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
        session = await configure(connection, instructions="Read the user's text aloud verbatim.", tools=tools,
                                  audio={"output": {"voice": "vivian", "format": {"type": "audio/pcm", "rate": 24000},
                                                    "speed": 1.2}})
        assert session["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "vivian",
                                              "speed": 1.2}
        # the boilerplate is dropped (nothing is left of the style); the tools (echoed) and the speed (the audio
        # streams) named as ignored
        assert session["omni_tts"] == {"style_instructions": None, "ignored_fields": ["tools", "audio.output.speed"]}
        assert session["tools"] == tools
        await connection.conversation.item.create(item=user_message("Hello there,"))
        await connection.conversation.item.create(item=user_message("this is one turn."))
        added = [(await connection.recv()).type for _ in range(4)]
        assert added == ["conversation.item.added", "conversation.item.done"] * 2
        await connection.response.create()
        types, audio, events = await response(connection)
        assert types == [*RESPONSE_EVENTS[:2], "conversation.item.added", *RESPONSE_EVENTS[2:-1],
                         "conversation.item.done", "response.done"]
        spoken = "Hello there,\nthis is one turn."   # the new user items, one line each
        assert_same_audio(audio, await speech(url, spoken))
        assert events["response.output_audio_transcript.delta"].delta == spoken
        assert events["response.output_audio_transcript.done"].transcript == spoken
        done = events["response.done"].response
        assert done.conversation_id is not None and done.output[0].content[0].transcript == spoken
        assert 0 < done.usage.output_tokens <= 48 and done.usage.input_tokens > 0
        # max_output_tokens is the talker's frame limit: a response cut by it is incomplete
        assert done.status == "completed" or (done.status_details.type, done.status_details.reason) == (
            "incomplete", "max_output_tokens")
        # the items were spoken: nothing new is left for the next in-band response
        await connection.response.create()
        error = (await response(connection))[2]["error"].error
        assert (error.code, error.param) == ("no_text_to_speak", "response.input")
    assert state.admitted == 0 and not state.tts.requests


@pytest.mark.asyncio(loop_scope="session")
async def test_an_out_of_band_response_speaks_its_own_input_in_its_format_and_style(in_process_app):
    url, state = in_process_app
    async with connect(url) as connection:
        session = await configure(connection, audio={"output": {"voice": {"id": "vivian"},
                                                                "format": {"type": "audio/pcmu"}}})
        assert session["audio"]["output"]["voice"] == {"id": "vivian"}   # a custom voice's shape
        await connection.conversation.item.create(item=user_message("Not this one."))
        await connection.recv(), await connection.recv()
        await connection.response.create(response={
            "conversation": "none", "metadata": {"utt": "42"},
            "instructions": "Speak cheerfully. Say exactly the following text, nothing else.",
            "input": [user_message("Context an LLM would read."),
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok."}]},
                      user_message(TEXT)]})
        types, audio, events = await response(connection)
        assert types == RESPONSE_EVENTS   # no conversation events: out of band
        done = events["response.done"].response
        assert done.conversation_id is None and done.metadata == {"utt": "42"}
        assert done.audio.output.format.type == "audio/pcmu"
        assert events["response.output_audio_transcript.done"].transcript == TEXT
        # pcmu is our ulaw, streamed; the style is what is left of the instructions
        assert_same_audio(audio, await speech(url, TEXT, response_format="ulaw", stream_format="audio",
                                              instructions="Speak cheerfully."), "ulaw")
        # the conversation's new item is still there for an in-band response, in the session's format
        await connection.response.create(response={"audio": {"output": {"format": {"type": "audio/pcm",
                                                                                    "rate": 24000}}}})
        types, audio, events = await response(connection)
        assert events["response.output_audio_transcript.done"].transcript == "Not this one."
        assert_same_audio(audio, await speech(url, "Not this one."))
    assert state.admitted == 0 and not state.tts.requests


@pytest.mark.asyncio(loop_scope="session")
async def test_response_cancel_cuts_the_audio_and_the_next_response_is_exact(in_process_app):
    url, state = in_process_app
    async with connect(url) as connection:
        await configure(connection, temperature=0, max_output_tokens="inf", audio={"output": {"voice": "vivian"}})
        await connection.response.create(response={"conversation": "none", "input": [user_message(RUNS_TO_ITS_LIMIT)]})
        async for event in connection:
            if event.type == "response.output_audio.delta":
                break   # audio is flowing, far from its 191 frames
        await connection.response.cancel()
        types, audio, events = await response(connection)
        assert len(base64.b64decode(event.delta) + audio) < 191 * 1920 * 2   # cut: 16-bit samples at 24 kHz
        assert types[-5:] == RESPONSE_EVENTS[-5:]   # the closing events follow, with what was made
        done = events["response.done"].response
        assert done.status == "cancelled" and done.output[0].status == "incomplete"
        assert (done.status_details.type, done.status_details.reason) == ("cancelled", "client_cancelled")
        assert done.usage is None
        assert state.admitted == 0 and not state.tts.requests   # aborted in the stages, its slot free
        await connection.session.update(session={"type": "realtime", **GREEDY_SESSION})
        assert (await connection.recv()).type == "session.updated"
        await connection.conversation.item.create(item=user_message(TEXT))
        await connection.recv(), await connection.recv()
        await connection.response.create()
        types, audio, events = await response(connection)
        assert events["response.done"].response.status in ("completed", "incomplete")
        assert_same_audio(audio, await speech(url, TEXT))
        await connection.response.cancel()   # nothing in progress
        error = (await response(connection))[2]["error"].error
        assert (error.code, error.param) == ("response_cancel_not_active", "response_id")
    assert state.admitted == 0 and not state.tts.requests


@pytest.mark.asyncio(loop_scope="session")
async def test_a_client_that_goes_away_mid_response_cuts_it(in_process_app):
    url, state = in_process_app
    async with connect(url) as connection:
        await configure(connection, temperature=0, max_output_tokens="inf")
        await connection.response.create(response={"conversation": "none", "input": [user_message(RUNS_TO_ITS_LIMIT)]})
        async for event in connection:
            if event.type == "response.output_audio.delta":
                break
        assert state.admitted == 1
    await eventually_async(lambda: state.admitted == 0 and not state.tts.requests, what="the response cut")


@pytest.mark.asyncio(loop_scope="session")
async def test_bad_events_get_the_error_event_and_an_oversized_one_ends_the_session(in_process_app):
    url, state = in_process_app
    async with aiohttp.ClientSession() as http, http.ws_connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        assert (await ws.receive_json())["type"] == "session.created"

        async def error_for(send) -> dict:
            await send
            event = await ws.receive_json()
            assert event["type"] == "error", event
            assert set(event["error"]) == {"type", "code", "message", "param", "event_id"}
            return event["error"]

        error = await error_for(ws.send_json({"type": "response.speak", "event_id": "evt_1"}))
        assert (error["code"], error["param"], error["event_id"]) == ("unknown_event", "type", "evt_1")
        error = await error_for(ws.send_str('{"type": "response.create",'))
        assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
        error = await error_for(ws.send_bytes(b"\0\1"))
        assert error["code"] == "binary_not_supported"
        error = await error_for(ws.send_json({"type": "input_audio_buffer.append", "audio": "AAAA"}))
        assert error["code"] == "audio_input_not_supported"
        error = await error_for(ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]}}))
        assert error["code"] == "audio_input_not_supported"
        error = await error_for(ws.send_json({"type": "response.create", "event_id": "evt_2"}))
        assert (error["code"], error["event_id"]) == ("no_text_to_speak", "evt_2")
        error = await error_for(ws.send_json({"type": "response.create", "response": {
            "conversation": "none", "input": [user_message("   ")]}}))
        assert error["code"] == "no_text_to_speak"
        error = await error_for(ws.send_json({"type": "session.update", "session": {
            "audio": {"output": {"voice": "nobody"}}}}))
        assert error["message"].startswith("unknown voice 'nobody'") and error["param"] == "voice"
        error = await error_for(ws.send_json({"type": "session.update", "session": {"model": "tts-0"}}))
        assert (error["code"], error["param"]) == ("model_not_found", "model") and "tts-0" in error["message"]
        assert state.admitted == 0 and not state.tts.requests
        # the session goes on, as it was: the unknown voice did not stick
        await ws.send_json({"type": "session.update", "session": {"type": "realtime"}})
        updated = await ws.receive_json()
        assert updated["type"] == "session.updated"
        assert updated["session"]["audio"]["output"]["voice"] == state.voice_names.default   # the server's default
        await ws.send_str(json.dumps({"type": "conversation.item.create",
                                      "item": user_message("x" * (MAX_MESSAGE_BYTES + 1))}))
        error = (await ws.receive_json())["error"]
        assert error["code"] == "message_too_large"
        closing = await ws.receive()
        assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == aiohttp.WSCloseCode.OK
    assert state.admitted == 0 and not state.tts.requests


@pytest.mark.asyncio(loop_scope="session")
async def test_an_idle_session_ends_with_the_error_event_then_the_close():
    """The app alone (its pipeline never started: an idle session needs none), with a short idle limit."""
    tts = AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny"))
    app = build_app(tts, ServerConfig(served_model_names=("m",), stream_idle_timeout=0.2))
    async with TestServer(app) as server, aiohttp.ClientSession() as http, \
            http.ws_connect(server.make_url("/v1/realtime")) as ws:
        created = await ws.receive_json()
        assert created["type"] == "session.created" and created["session"]["model"] == "m"
        error = (await ws.receive_json())["error"]
        assert error["code"] == "session_idle_timeout" and "no event for 0.2 s" in error["message"]
        assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE


def test_a_verbatim_pattern_that_is_not_a_regular_expression_is_refused():
    with pytest.raises(ValueError, match="--realtime-verbatim-pattern is not a regular expression"):
        ServerConfig(served_model_names=("m",), realtime_verbatim_pattern="(")
