"""DashScope's plain HTTP call to Qwen-TTS (POST /api/v1/services/aigc/multimodal-generation/generation), driven by
the `dashscope` SDK's MultiModalConversation.call, unmodified, pointed at the server by the base URL the SDK reads
(`dashscope.base_http_api_url`, or DASHSCOPE_HTTP_BASE_URL before it is imported): the whole call's audio (by URL)
and the streamed call's (base64 PCM) equal /v1/audio/speech's; errors in DashScope's shape; --api-key guards the
calls, not the audio links. Plus the audio store's bounds."""
import asyncio
import base64
import subprocess
import sys

import aiohttp
import dashscope
import pytest
import requests
from aiohttp.test_utils import TestServer

from audio_util import assert_same_audio
from conftest import FIXTURES
from omni_tts.config.stage_config import load_stage_config
from omni_tts.entrypoints.api.app import build_app
from omni_tts.entrypoints.api.dashscope.audio_links import AudioLinks
from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.entrypoints.api.server_config import ServerConfig
from omni_tts.orchestrator.async_tts import AsyncTTS
from server_util import MODEL, environment, request

GREEDY = {"temperature": 0.0, "max_new_tokens": 48}
TEXT = "Hello there, this is one call."


@pytest.fixture
def base_url(cv_server, monkeypatch):
    monkeypatch.setattr(dashscope, "base_http_api_url", cv_server.url + "/api/v1")
    return cv_server.url


def speech(url: str, **fields) -> bytes:
    status, _, body = request(url + "/v1/audio/speech", dict(GREEDY, model=MODEL, input=TEXT, voice="vivian",
                                                             **fields))
    assert status == 200, body
    return body


def whole_call(**fields) -> tuple[object, bytes]:
    response = dashscope.MultiModalConversation.call(model="qwen3-tts-flash", api_key="any-key", text=TEXT,
                                                     voice="vivian", **GREEDY, **fields)
    assert response.status_code == 200, response.message
    download = requests.get(response.output.audio.url, timeout=60)   # as DashScope's sample: the URL is enough
    assert download.status_code == 200 and download.headers["Content-Type"] == "audio/wav"
    return response, download.content


def test_a_whole_call_returns_its_audio_by_url_equal_to_the_speech_route(base_url):
    response, wav = whole_call(language_type="English", volume=60)
    assert response.output.finish_reason == "stop" and response.output.audio.data == ""
    assert response.usage.characters == len(TEXT)
    assert response.headers["x-omni-tts-ignored-fields"] == "volume"
    expected = speech(base_url, response_format="wav", language="english")
    assert wav[:44] == expected[:44]
    assert_same_audio(wav[44:], expected[44:])
    _, faster = whole_call(language_type="English", speech_rate=2.0)   # our speed change: half the samples
    assert len(faster) - 44 == 2 * round((len(wav) - 44) / 2 / 2.0)


def test_a_streamed_call_sends_base64_pcm_equal_to_the_speech_route(base_url):
    chunks = list(dashscope.MultiModalConversation.call(model="qwen3-tts-flash", api_key="any-key", text=TEXT,
                                                        voice="vivian", stream=True, **GREEDY))
    assert all(chunk.status_code == 200 for chunk in chunks)
    assert [chunk.output.finish_reason for chunk in chunks] == ["null"] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1].usage.characters == len(TEXT)
    pcm = b"".join(base64.b64decode(chunk.output.audio.data) for chunk in chunks)
    assert len(chunks) > 2
    assert_same_audio(pcm, speech(base_url, response_format="pcm"))


def test_errors_come_in_dashscopes_shape(base_url):
    response = dashscope.MultiModalConversation.call(model="qwen3-tts-flash", api_key="any-key", text=TEXT,
                                                     voice="nobody")
    assert (response.status_code, response.code) == (400, "InvalidParameter")
    assert "unknown voice 'nobody'" in response.message and response.request_id
    status, _, body = request(base_url + "/api/v1/audio/audio_0123")
    assert status == 404 and b'"code": "NotFound"' in body


def test_the_sdk_follows_dashscope_http_base_url(cv_server):
    """The zero-code switch: the variable is read when the SDK is imported."""
    script = ("import dashscope; r = dashscope.MultiModalConversation.call(model='qwen3-tts-flash', api_key='k', "
              "text='Hi.', voice='vivian', max_new_tokens=8); print(r.status_code, r.output.audio.url)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=environment({"DASHSCOPE_HTTP_BASE_URL": cv_server.url + "/api/v1"}))
    assert result.stdout.startswith(f"200 {cv_server.url}/api/v1/audio/audio_"), result.stderr


@pytest.mark.asyncio
async def test_the_api_key_guards_the_calls_not_the_audio_links(monkeypatch):
    """Nothing here reaches the pipeline, which is not started."""
    engine = AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny"))
    app = build_app(engine, ServerConfig(served_model_names=(MODEL,), api_key="the-key"))
    async with TestServer(app) as server, aiohttp.ClientSession() as http:
        monkeypatch.setattr(dashscope, "base_http_api_url", str(server.make_url("/api/v1")))
        response = await asyncio.to_thread(dashscope.MultiModalConversation.call, model="qwen3-tts-flash",
                                           api_key="wrong", text=TEXT, voice="vivian")
        assert (response.status_code, response.code) == (401, "InvalidApiKey")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(server.make_url("/api-ws/v1/realtime"), headers={"Authorization": "Bearer wrong"})
        assert refused.value.status == 401
        async with http.get(server.make_url("/api/v1/audio/audio_0123")) as download:
            assert download.status == 404   # not 401: the link is its own permission


def test_the_audio_store_is_bounded_and_expires():
    links = AudioLinks(max_bytes=10, ttl=60.0)
    first, _ = links.add(b"123456")
    second, _ = links.add(b"abcdef")   # no room for both: the oldest goes
    assert list(links.files) == [second] and links.stored_bytes == 6
    with pytest.raises(ApiError, match="larger than"):
        links.add(b"x" * 11)
    expired = AudioLinks(ttl=0.0)
    expired.add(b"123")
    expired.add(b"456")   # the first had expired: dropped, whatever the room
    assert len(expired.files) == 1
