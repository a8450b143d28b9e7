"""LoRA adapters served as models (issue 36): `--lora NAME=DIR` at start-up and vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter at run time (from under `--lora-dir`). Each adapter's speech equals offline synthesis with it
(tests/engine/test_lora_engine.py: equal to its weights merged), requests on two adapters and the base model at once
each get their own; an adapter loaded while another one's utterance streams leaves that one exact; one loaded at run
time comes back with its talker after an idle unload; a fine-tuned checkpoint is served beside its base; bad adapters are a 4xx (or, at start-up, one line and status 2)
naming the file."""
import asyncio
import concurrent.futures
import json
import subprocess
import sys

import aiohttp
import pytest

from audio_util import assert_same_audio
from conftest import FIXTURES
from lora_util import write_merged
from server_util import ServerProcess, free_port, request
from test_speech_stream import GREEDY, TEXT, Session
from waiting import eventually
from omni_tts.audio.pcm import to_int16
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.lora import read_adapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_adapter
from omni_tts.models.qwen3_tts.sampling import SamplingParams

BASE = FIXTURES / "tiny-custom-voice"
SPEECH = {"input": "An adapter's own voice.", "voice": "ryan", "response_format": "pcm", **GREEDY}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The --lora-dir: adapters a1 and a2 (two seeds), a rank-32 one (over the default maximum, 16)."""
    root = tmp_path_factory.mktemp("loras")
    for name, seed, rank in (("a1", 1, 4), ("a2", 2, 4), ("rank32", 3, 32)):
        make_random_adapter(str(root / name), str(BASE), seed=seed, rank=rank)
    return root


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    """narrator with adapter calm (a1), and beside it `tuned`: a checkpoint fine-tuned from narrator's (its weights
    with a1 merged in)."""
    tts = Qwen3TTS.from_pretrained(str(BASE))
    tuned = write_merged(BASE, read_adapter(str(adapters / "a1"), tts.config.talker, 16),
                         tmp_path_factory.mktemp("tuned") / "tuned")
    server = ServerProcess("--model", f"narrator={BASE}", "--model", f"tuned={tuned}", "--lora",
                           f"calm={adapters / 'a1'}", "--lora-dir", str(adapters))
    yield server
    server.stop()


def speak(server, body):
    status, headers, data = request(server.url + "/v1/audio/speech", body)
    assert status == 200, data
    return data


def offline_pcm(adapter_dir, body=SPEECH) -> bytes:
    tts = Qwen3TTS.from_pretrained(str(BASE))
    adapter = read_adapter(str(adapter_dir), tts.config.talker, 16) if adapter_dir else None
    request = SynthesisRequest(text=body["input"], voice=body["voice"],
                               non_streaming_mode=body.get("non_streaming_mode"),
                               sampling=SamplingParams(temperature=0, max_new_tokens=body["max_new_tokens"]))
    return to_int16(synthesize(tts, [request], loras=[adapter])[0].audio).tobytes()


def load(server, name, path, **extra):
    return request(server.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def test_two_adapters_and_the_base_model_at_once_each_exact(server, adapters):
    assert load(server, "bright", "a2")[0] == 200   # relative to --lora-dir
    models = ["narrator", "calm", "bright"] * 3
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(lambda model: speak(server, SPEECH | {"model": model}), models))
    expected = {"narrator": offline_pcm(None), "calm": offline_pcm(adapters / "a1"),
                "bright": offline_pcm(adapters / "a2")}
    assert len(set(expected.values())) == 3   # the adapters change the speech
    for model, audio in zip(models, got):
        assert_same_audio(audio, expected[model])
    entries = json.loads(request(server.url + "/v1/models")[2])["data"]
    assert {(e["id"], e.get("parent")) for e in entries if e.get("parent")} == {("calm", "narrator"),
                                                                                 ("bright", "narrator")}
    status, _, text = request(server.url + "/v1/unload_lora_adapter", {"lora_name": "bright"})
    assert (status, text) == (200, b"Success: LoRA adapter 'bright' removed successfully.")
    status, _, body = request(server.url + "/v1/audio/speech", SPEECH | {"model": "bright"})
    assert status == 404 and "available: narrator" in json.loads(body)["error"]["message"]


def test_an_adapter_loaded_while_another_streams_leaves_it_exact(server, adapters):
    """Held by state: calm's utterance waits for the rest of its text while `late` loads and speaks."""
    words = TEXT.split(" ")

    async def main() -> bytes:
        async with aiohttp.ClientSession() as http:
            session = Session(await http.ws_connect(server.url + "/v1/audio/speech/stream"))
            await session.send({"type": "session.config", "model": "calm", "response_format": "pcm",
                                "stream_audio": True, "voice": "ryan", **GREEDY})
            await session.send({"type": "input.text", "text": " ".join(words[:12]) + " "})
            pcm = b""
            while not pcm:
                event = await asyncio.wait_for(session.events.get(), 60)
                pcm = event if isinstance(event, bytes) else b""
            status, _, answer = await asyncio.to_thread(load, server, "late", adapters / "a2")
            assert status == 200, answer
            late = await asyncio.to_thread(speak, server, SPEECH | {"model": "late"})
            assert_same_audio(late, offline_pcm(adapters / "a2"))
            result = await session.utterance([" ".join(words[12:])], [0])
            await session.ws.close()
            return pcm + result["pcm"]

    streamed = asyncio.run(main())
    whole = SPEECH | {"model": "calm", "input": TEXT, "non_streaming_mode": False}
    assert_same_audio(streamed, speak(server, whole))
    assert request(server.url + "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200


@pytest.mark.parametrize("body,status,message", [
    ({"lora_name": "x", "lora_path": "missing"}, 400, "missing: no such adapter directory"),
    ({"lora_name": "x", "lora_path": "rank32"}, 400, "rank32"),
    ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path /etc: outside the server's --lora-dir"),
    ({"lora_name": "narrator", "lora_path": "a2"}, 400, "'narrator' names a served model or adapter already"),
    ({"lora_name": "x", "lora_path": "a2", "base_model_name": "nope"}, 404, "model 'nope' is not served here"),
    ({"lora_name": 3}, 400, "invalid body"),
], ids=["missing-files", "rank-over-the-maximum", "outside-the-lora-dir", "a-models-name", "unknown-base",
        "bad-body"])
def test_bad_adapters_are_refused_naming_the_file(server, adapters, body, status, message):
    got, _, answer = request(server.url + "/v1/load_lora_adapter", body)
    error = json.loads(answer)["error"]
    assert got == status and message in error["message"], error
    if body.get("lora_path") in ("missing", "rank32"):
        assert str(adapters) in error["message"] and error["param"] == "lora_path"


def test_unloading_an_adapter_not_loaded_is_a_404(server):
    status, _, answer = request(server.url + "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert status == 404 and json.loads(answer)["error"]["param"] == "lora_name"


def test_a_bad_start_up_adapter_stops_the_start_naming_the_file(adapters):
    done = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--port", str(free_port()),
                           "--model", str(BASE), "--lora", f"big={adapters / 'rank32'}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 2, done.stdout
    assert done.stdout.startswith(f"omni-tts serve: error: --lora big: {adapters / 'rank32'}") \
        and done.stdout.count("\n") == 1, done.stdout


def test_an_adapter_loaded_at_run_time_comes_back_with_its_talker(adapters):
    """Idle unload stops the talker (its adapters with it); its next request starts it with them."""
    server = ServerProcess("--model", f"narrator={BASE}", "--lora-dir", str(adapters), "--idle-unload", "1")
    try:
        assert load(server, "bright", "a2")[0] == 200
        models = lambda: {e["id"]: e for e in json.loads(request(server.url + "/v1/models")[2])["data"]}  # noqa: E731
        eventually(lambda: not models()["narrator"]["capabilities"]["loaded"], what="the idle talker unloaded")
        assert_same_audio(speak(server, SPEECH | {"model": "bright"}), offline_pcm(adapters / "a2"))
    finally:
        server.stop()


def test_a_fine_tuned_checkpoint_is_served_beside_its_base(server, adapters):
    """A checkpoint fine-tuned from the base is a model of its own, sharing the base's code2wav (the same decoder),
    and speaks as the adapter merged into it does."""
    assert "(2 talkers, 1 code2wav)" in server.output()
    assert_same_audio(speak(server, SPEECH | {"model": "tuned"}), offline_pcm(adapters / "a1"))
