"""One server, several models (issue 36): `omni-tts serve --model A --model B --model C` with the tiny CustomVoice,
VoiceDesign and Base checkpoints, one talker each and one code2wav for the three. Each request is routed by its
`model`; every golden case through it gives the single-model server's audio (CustomVoice and Base: the session's
single-model servers; VoiceDesign: offline synthesis), all the cases at once; /v1/models says what each model can do;
a model idle past --idle-unload is unloaded and its next request loads it (and says so) while another model's stream
goes on, exact."""
import asyncio
import concurrent.futures
import json
import subprocess
import sys

import aiohttp
import openai
import pytest
from elevenlabs import ElevenLabs

from audio_util import assert_same_audio
from conftest import FIXTURES, GOLDEN_CASES, case_rows
from server_util import MODEL, ServerProcess, free_port, request, stage_pids
from test_speech_stream import GREEDY, TEXT, Session
from waiting import eventually
from omni_tts.entrypoints.api.served_models import MODEL_LOAD_HEADER
from omni_tts.audio.pcm import to_int16
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams

NAMES = {"tiny-custom-voice": "narrator", "tiny-voice-design": "designer", "tiny-base": "clone"}
CASES = [case for case in GOLDEN_CASES if case["variant"] in NAMES]


# a golden row's reference arguments → the request's fields
FIELDS = {"speaker": "voice", "language": "language", "instruct": "instructions", "ref_text": "ref_text",
          "non_streaming_mode": "non_streaming_mode", "x_vector_only_mode": "x_vector_only_mode"}


def case_request(row: dict) -> dict:
    """A golden row's reference call as a greedy /v1/audio/speech body (raw 16-bit PCM)."""
    body = {"input": row["text"], "temperature": 0, "max_new_tokens": row["max_new_tokens"], "response_format": "pcm"}
    body |= {field: row[key] for key, field in FIELDS.items() if row.get(key) is not None}
    if row.get("ref_audio"):
        body["ref_audio"] = str(FIXTURES / row["ref_audio"])
    return body


def offline_pcm(variant: str, body: dict) -> bytes:
    """What synthesize gives for the request `body` makes, as raw 16-bit PCM."""
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    request = SynthesisRequest(text=body["input"], voice=body.get("voice"), language=body.get("language"),
                               instructions=body.get("instructions"),
                               non_streaming_mode=body.get("non_streaming_mode"),
                               sampling=SamplingParams(temperature=0, max_new_tokens=body["max_new_tokens"]))
    return to_int16(synthesize(tts, [request])[0].audio).tobytes()


def several_models(models_file, *extra: str) -> ServerProcess:
    """narrator and designer given by --model, clone (also named clone-2) by a --models file."""
    models_file.write_text(f"models:\n  - model: {FIXTURES / 'tiny-base'}\n    served_model_name: [clone, clone-2]\n")
    return ServerProcess("--model", f"narrator={FIXTURES / 'tiny-custom-voice'}", "--model",
                         f"designer={FIXTURES / 'tiny-voice-design'}", "--models", str(models_file),
                         "--allowed-local-media-path", str(FIXTURES), *extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = several_models(tmp_path_factory.mktemp("models") / "models.yaml")
    yield server
    server.stop()


def speak(server, body):
    status, headers, data = request(server.url + "/v1/audio/speech", body)
    assert status == 200, data
    return headers, data


def test_one_code2wav_process_serves_the_three_models(server):
    names = []
    for pid in stage_pids(server.proc.pid):
        with open(f"/proc/{pid}/comm") as f:
            names.append(f.read().strip())
    assert sorted(names) == ["omni-tts-code2w", "omni-tts-talker", "omni-tts-talker", "omni-tts-talker"]
    assert "(3 talkers, 1 code2wav)" in server.output()


def test_models_lists_each_model_with_what_it_can_do(server):
    status, _, data = request(server.url + "/v1/models")
    entries = {entry["id"]: entry for entry in json.loads(data)["data"]}
    assert [(name, entry["root"]) for name, entry in entries.items() if not name.startswith(("tts-", "gpt-"))] == [
        ("narrator", "narrator"), ("designer", "designer"), ("clone", "clone"), ("clone-2", "clone")]
    narrator, designer, clone = (entries[name] for name in NAMES.values())
    assert narrator["task_type"] == "CustomVoice" and "ryan" in narrator["capabilities"]["speakers"]
    assert designer["capabilities"] | {"loaded": True} == {"speakers": [], "voice_design": True, "voice_clone": False,
                                                           "instructions": True, "loaded": True}
    assert clone["task_type"] == "Base" and clone["capabilities"]["voice_clone"]
    assert entries["tts-1"]["root"] == "narrator"   # OpenAI's names stand for the default model


def test_a_model_not_served_is_a_404_listing_the_served_names(server):
    status, _, data = request(server.url + "/v1/audio/speech", {"model": "nope", "input": "Hi."})
    error = json.loads(data)["error"]
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert "available: narrator, designer, clone" in error["message"]


def test_every_golden_case_equals_the_single_model_servers_all_at_once(server, cv_server, base_server):
    bodies = [(case, case_request(row)) for case in CASES for row in case_rows(case)]
    single = {"tiny-custom-voice": cv_server, "tiny-base": base_server}
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda item: speak(server, item[1] | {"model": NAMES[item[0]["variant"]]})[1], bodies))
    for (case, body), audio in zip(bodies, got):
        if case["variant"] in single:
            expected = speak(single[case["variant"]], body | {"model": MODEL})[1]
        else:
            expected = offline_pcm(case["variant"], body)
        assert_same_audio(audio, expected)


def loaded(server, name: str) -> bool:
    entries = json.loads(request(server.url + "/v1/models")[2])["data"]
    return next(entry for entry in entries if entry["id"] == name)["capabilities"]["loaded"]


def test_an_idle_model_is_unloaded_and_its_next_request_loads_it_while_another_streams(cv_server, tmp_path):
    """Held by state: the narrator's utterance waits for the rest of its text (its request in flight in the stages)
    while the designer, idle past --idle-unload, is unloaded and then loaded again by a request."""
    server = several_models(tmp_path / "models.yaml", "--idle-unload", "1")
    words = TEXT.split(" ")
    voice = {"voice": "ryan", **GREEDY}
    design = {"model": "designer", "input": "A designed voice.", "instructions": "A calm, deep voice.",
              "language": "english", "response_format": "pcm", **GREEDY}

    async def narrate_while_the_designer_loads() -> tuple[bytes, dict, bytes]:
        async with aiohttp.ClientSession() as http:
            session = Session(await http.ws_connect(server.url + "/v1/audio/speech/stream"))
            await session.send({"type": "session.config", "model": "narrator", "response_format": "pcm",
                                "stream_audio": True, **voice})
            await session.send({"type": "input.text", "text": " ".join(words[:12]) + " "})
            pcm = b""
            while not pcm:   # the narrator streams; its request waits for the rest of the text
                event = await asyncio.wait_for(session.events.get(), 60)
                pcm = event if isinstance(event, bytes) else b""
            eventually(lambda: not loaded(server, "designer"), what="the idle designer unloaded")
            headers, designed = await asyncio.to_thread(speak, server, design)
            assert loaded(server, "designer")
            result = await session.utterance([" ".join(words[12:])], [0])
            await session.ws.close()
            return pcm + result["pcm"], headers, designed

    try:
        narrated, headers, designed = asyncio.run(narrate_while_the_designer_loads())
        assert float(headers[MODEL_LOAD_HEADER]) > 0   # the request waited for the load, and says so
        assert_same_audio(designed, offline_pcm("tiny-voice-design", design))
        whole = {"model": MODEL, "input": TEXT, "response_format": "pcm", "non_streaming_mode": False, **voice}
        assert_same_audio(narrated, speak(cv_server, whole)[1])
        assert "stage talker:designer unloaded" in server.output()
    finally:
        server.stop()


@pytest.mark.parametrize("args,message", [
    (["--model", f"={FIXTURES / 'tiny-base'}"], "--model takes MODEL or NAME[,NAME...]=MODEL, got '="),
    (["--model", f"a={FIXTURES / 'tiny-base'}", "--model", f"b,a={FIXTURES / 'tiny-voice-design'}"],
     f"--model {FIXTURES / 'tiny-voice-design'}: the name 'a' is another model's already; name it (NAME=MODEL)"),
    (["--model", f"a={FIXTURES / 'tiny-base'}", "--served-model-name", "b"],
     "--served-model-name names the first --model, which names itself already (NAME=MODEL)"),
    (["--models", str(FIXTURES / "ref_voice.txt")], f"--models {FIXTURES / 'ref_voice.txt'}: needs a non-empty list "
                                                    "under 'models'"),
], ids=["no-name", "a-name-twice", "two-names-for-the-first", "a-models-file-without-models"])
def test_model_options_that_cannot_be_served_stop_the_start(args, message):
    done = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--port", str(free_port()),
                           *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 2, done.stdout
    assert done.stdout.startswith(f"omni-tts serve: error: {message}") and done.stdout.count("\n") == 1, done.stdout


def test_the_other_apis_route_by_model_too(server):
    """The `model` of OpenAI's SDK and ElevenLabs' `model_id` pick the model as /v1/audio/speech's does."""
    design = {"input": "Routed by model.", "instructions": "A calm, deep voice.", "language": "english",
              "response_format": "pcm", **GREEDY}
    expected = speak(server, design | {"model": "designer"})[1]
    openai_sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    spoken = openai_sdk.audio.speech.create(model="designer", voice="alloy", input=design["input"],
                                            instructions=design["instructions"], response_format="pcm",
                                            extra_body={"language": "english", **GREEDY}).read()
    assert_same_audio(spoken, expected)
    eleven = ElevenLabs(base_url=server.url, api_key="unused").text_to_speech
    plain = speak(server, {"model": "clone", "input": "Routed by model.", "response_format": "pcm",
                           "ref_audio": str(FIXTURES / "ref_voice.wav"), "x_vector_only_mode": True, **GREEDY})[1]
    cloned = b"".join(eleven.convert("unused", text="Routed by model.", model_id="clone", output_format="pcm_24000",
                                     request_options={"additional_body_parameters": {
                                         "ref_audio": str(FIXTURES / "ref_voice.wav"), "x_vector_only_mode": True,
                                         **GREEDY}}))
    assert_same_audio(cloned, plain)


def test_metrics_and_health_name_every_models_stages(server):
    speak(server, {"model": "designer", "input": "Counted.", "instructions": "A calm voice.", **GREEDY})
    metrics = request(server.url + "/metrics")[2].decode()
    for stage in ("talker", "talker:designer", "talker:clone", "code2wav"):
        assert f'omni_tts_stage_steps_total{{stage="{stage}"}}' in metrics, stage
    assert json.loads(request(server.url + "/health")[2])["status"] == "healthy"
