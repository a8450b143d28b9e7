"""SpeechTurn, the response of every realtime protocol: text in pieces speaks as /v1/audio/speech speaks it whole,
and a cancelled turn leaves nothing admitted or running, so the next turn is exact."""
import aiohttp
import pytest

from audio_util import assert_same_audio

from omni_tts.entrypoints.api.schema import SpeechOptions
from omni_tts.entrypoints.api.speech_turn import SpeechTurn, prepare_voice

GREEDY = {"temperature": 0.0, "max_new_tokens": 48}
TEXT = "Hello there, this is one turn."


async def speech_pcm(url: str, text: str) -> bytes:
    body = dict(GREEDY, model="m", input=text, voice="vivian", response_format="pcm", non_streaming_mode=False)
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/audio/speech", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.read()


async def turn_pcm(state, pieces: list[str], request_id: str) -> tuple[bytes, object]:
    voice = await prepare_voice(state, SpeechOptions(voice="vivian", response_format="pcm", **GREEDY))
    turn = SpeechTurn(state, voice, request_id)
    await turn.start()
    try:
        for piece in pieces:
            await turn.append(piece)
        await turn.finish()
        audio, usage = b"", None
        async for piece in turn.audio():
            audio += piece.data
            usage = piece.usage or usage
        return audio, usage
    finally:
        await turn.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_turn_in_pieces_equals_the_speech_route(in_process_app):
    url, state = in_process_app
    audio, usage = await turn_pcm(state, ["  ", "Hello the", "re, this is", " one turn."], "turn-pieces")
    assert usage is not None and usage.output_frames > 0
    assert_same_audio(audio, await speech_pcm(url, "  " + TEXT))   # the whitespace waited for the first word
    assert state.admitted == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_a_cancelled_turn_frees_its_slot_and_the_next_is_exact(in_process_app):
    url, state = in_process_app
    voice = await prepare_voice(state, SpeechOptions(voice="vivian", response_format="pcm", **GREEDY))
    turn = SpeechTurn(state, voice, "turn-cancelled")
    await turn.start()
    assert state.admitted == 1
    await turn.append(TEXT)
    pieces = turn.audio()
    first = await anext(pieces)   # audio is flowing, the text never finished: the request is mid-stream
    assert first.data and first.usage is None
    await pieces.aclose()
    await turn.cancel()
    await turn.cancel()   # idempotent
    assert state.admitted == 0
    assert not state.tts.requests   # aborted in the stages, not only let go of here
    audio, _ = await turn_pcm(state, [TEXT], "turn-after-cancel")
    assert_same_audio(audio, await speech_pcm(url, TEXT))
