"""Barge-in on our WebSocket (WS /v1/audio/speech/stream): input.cancel stops the utterance in progress — in token
mode while its text still streams, and after input.done while it is being spoken — with no audio of it after
input.cancelled, its request gone from the pipeline and its slot free; the next utterance in the same session is
exact."""
import asyncio
import json

import aiohttp
import pytest

from audio_util import assert_same_audio

GREEDY = {"temperature": 0, "max_new_tokens": 48}
TEXT = "The answer is coming now, word by word."


async def speech_pcm(url: str, text: str) -> bytes:
    body = dict(GREEDY, model="m", input=text, voice="vivian", response_format="pcm", non_streaming_mode=False)
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/audio/speech", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.read()


async def until_audio(ws) -> None:
    while (await asyncio.wait_for(ws.receive(), 60)).type != aiohttp.WSMsgType.BINARY:
        pass


async def until_cancelled(ws) -> dict:
    """input.cancelled; audio still on its way before it is fine, none may follow it (checked by the caller's next
    utterance, whose audio must be exact)."""
    while True:
        message = await asyncio.wait_for(ws.receive(), 60)
        if message.type == aiohttp.WSMsgType.TEXT:
            event = json.loads(message.data)
            assert event["type"] != "error", event
            if event["type"] == "input.cancelled":
                return event


async def utterance_pcm(ws, text: str) -> bytes:
    await ws.send_json({"type": "input.text", "text": text})
    await ws.send_json({"type": "input.done"})
    audio = b""
    while True:
        message = await asyncio.wait_for(ws.receive(), 60)
        if message.type == aiohttp.WSMsgType.BINARY:
            audio += message.data
            continue
        event = json.loads(message.data)
        assert event["type"] not in ("error", "input.cancelled"), event
        if event["type"] == "session.done":
            return audio


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("when", ["text streaming", "after input.done"])
async def test_input_cancel_stops_the_utterance_and_the_next_is_exact(in_process_app, when):
    url, state = in_process_app
    async with aiohttp.ClientSession() as http, http.ws_connect(url.replace("http", "ws") +
                                                                "/v1/audio/speech/stream") as ws:
        await ws.send_json({"type": "session.config", "voice": "vivian", "response_format": "pcm",
                            "stream_audio": True, **GREEDY})
        await ws.send_json({"type": "input.text", "text": TEXT})
        if when == "after input.done":
            await ws.send_json({"type": "input.done"})
        await until_audio(ws)
        await ws.send_json({"type": "input.cancel"})
        event = await until_cancelled(ws)
        assert event == {"type": "input.cancelled", "utterance_index": 0, "cancelled": True}
        assert state.admitted == 0
        assert not state.tts.requests   # aborted in the stages, not only let go of here
        assert_same_audio(await utterance_pcm(ws, TEXT), await speech_pcm(url, TEXT))
        await ws.send_json({"type": "input.cancel"})   # nothing in progress: answered, the session goes on
        assert await until_cancelled(ws) == {"type": "input.cancelled", "utterance_index": 2, "cancelled": False}
