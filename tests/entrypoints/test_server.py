"""The HTTP server as a real process on loopback: the official openai client, parity with offline synthesis,
SSE, voices, health/models/metrics, the ready line and access log, and a table of bad requests."""
import base64
import http.client
import importlib.metadata
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
import soundfile as sf

from conftest import FIXTURES, RUNS_TO_ITS_LIMIT
from omni_tts.audio.pcm import to_int16
from omni_tts.config import load_stage_config, stage_threads
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from openai.types.audio import Voice, VoiceDeleted
from server_util import MODEL, ServerProcess, free_port, request, stage_pids
from waiting import eventually, eventually_async

GREEDY = {"temperature": 0, "max_new_tokens": 24}
REF_WAV = FIXTURES / "ref_voice.wav"
REF_TEXT = (FIXTURES / "ref_voice.txt").read_text().strip()


def offline_pcm(variant, **kwargs):
    tts = _offline(variant)
    result = synthesize(tts, [SynthesisRequest(sampling=SamplingParams(**GREEDY), **kwargs)])[0]
    return to_int16(result.audio)


_tts = {}


def _offline(variant):
    if variant not in _tts:
        _tts[variant] = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    return _tts[variant]


def assert_pcm_close(pcm_bytes, expected):
    got = np.frombuffer(pcm_bytes, dtype="<i2")
    assert got.shape == expected.shape
    assert np.abs(got.astype(np.int32) - expected.astype(np.int32)).max() <= 1


def upload_voice(server, name, clip, **fields) -> dict:
    """POST /v1/audio/voices as a hand-made multipart form (the SDK has no ref_text); the stored voice."""
    status, answer = post_voice(server, name, clip, **fields)
    assert status == 200, answer[:300]
    return json.loads(answer)["voice"]


def post_voice(server, name, clip, **fields) -> tuple[int, bytes]:
    """POST /v1/audio/voices as a hand-made multipart form: (status, body)."""
    boundary = "omnittsboundary"
    parts = [(k.encode(), v.encode()) for k, v in dict(fields, name=name).items()]
    body = b"".join(b"--" + boundary.encode() + b'\r\nContent-Disposition: form-data; name="' + k + b'"\r\n\r\n' + v + b"\r\n"
                    for k, v in parts)
    body += (b"--" + boundary.encode() + b'\r\nContent-Disposition: form-data; name="audio_sample"; filename="v.wav"'
             b"\r\nContent-Type: audio/wav\r\n\r\n" + clip + b"\r\n--" + boundary.encode() + b"--\r\n")
    status, _, answer = request(server.url + "/v1/audio/voices", data=body,
                                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    return status, answer


def parse_sse(body):
    events = []
    for block in body.decode().split("\n\n"):
        data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
        if data:
            events.append(json.loads("".join(data)))
    return events


@pytest.fixture(scope="module")
def client(cv_server):
    return openai.OpenAI(base_url=cv_server.url + "/v1", api_key="unused")


def test_openai_client_wav_and_pcm_streaming(client):
    expected = offline_pcm("tiny-custom-voice", text="Hello from the OpenAI client.", voice="ryan")
    wav = client.audio.speech.create(model=MODEL, voice="ryan", input="Hello from the OpenAI client.",
                                     response_format="wav", extra_body=GREEDY)
    samples, sr = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert sr == 24000
    assert_pcm_close(samples.tobytes(), expected)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="ryan", input="Hello from the OpenAI client.", response_format="pcm",
            extra_body=dict(GREEDY, stream_format="audio")) as response:
        chunks = list(response.iter_bytes())
    assert_pcm_close(b"".join(chunks), expected)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="ryan", input="Hello from the OpenAI client.", response_format="wav",
            stream_format="audio", extra_body=GREEDY) as response:
        body = response.read()
    assert body[:4] == b"RIFF" and body[4:8] == b"\xff\xff\xff\xff"
    assert_pcm_close(body[44:], expected)


def test_sse_events_follow_the_openai_schema(client, cv_server):
    expected = offline_pcm("tiny-custom-voice", text="Server sent events.", voice="vivian")
    response = client.audio.speech.create(model=MODEL, voice="vivian", input="Server sent events.",
                                          response_format="pcm", stream_format="sse", extra_body=GREEDY)
    events = parse_sse(response.content)
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" and isinstance(e["audio"], str) for e in deltas)
    assert done["type"] == "speech.audio.done" and set(done["usage"]) >= {"input_tokens", "output_tokens", "total_tokens"}
    assert done["usage"]["output_tokens"] == expected.shape[0] // 1920
    assert_pcm_close(b"".join(base64.b64decode(e["audio"]) for e in deltas), expected)


def test_non_streaming_formats_and_speed(cv_server):
    payload = dict(GREEDY, model=MODEL, voice="ryan", input="Formats.")
    for fmt, ctype in (("flac", "audio/flac"), ("mp3", "audio/mpeg")):
        status, headers, body = request(cv_server.url + "/v1/audio/speech", dict(payload, response_format=fmt))
        assert status == 200 and headers["Content-Type"].startswith(ctype), (fmt, status, body[:200])
        assert len(body) > 100
    status, _, normal = request(cv_server.url + "/v1/audio/speech", dict(payload, response_format="pcm"))
    status, headers, fast = request(cv_server.url + "/v1/audio/speech",
                                    dict(payload, response_format="pcm", speed=2.0))
    assert status == 200 and abs(len(fast) / len(normal) - 0.5) < 0.05
    assert float(headers["x-omni-tts-audio-seconds"]) == pytest.approx(len(fast) / 2 / 24000, abs=5e-4)  # after speed


def test_openai_model_and_voice_names(client, cv_server):
    """What OpenAI clients send: tts-1 / gpt-4o-mini-tts are this model, alloy is the speaker vivian (names.py)."""
    expected = offline_pcm("tiny-custom-voice", text="OpenAI names.", voice="vivian")
    for model in ("tts-1", "gpt-4o-mini-tts"):
        response = client.audio.speech.with_raw_response.create(model=model, voice="alloy", input="OpenAI names.",
                                                                response_format="pcm", extra_body=GREEDY)
        assert_pcm_close(response.content, expected)
        assert float(response.headers["x-omni-tts-audio-seconds"]) == pytest.approx(
            expected.shape[0] / 24000, abs=5e-4)
        assert response.headers["x-omni-tts-finish-reason"] in ("stop", "length")
        assert "x-omni-tts-voice-ignored" not in response.headers
    assert [m.id for m in client.models.list().data] == [MODEL, "tts-1", "tts-1-hd", "gpt-4o-mini-tts",
                                                         "gpt-4o-mini-tts-2025-12-15"]
    voices = json.loads(request(cv_server.url + "/v1/audio/voices")[2])
    assert voices["voice_aliases"]["alloy"] == "vivian" and voices["voice_aliases"]["onyx"] == "uncle_fu"
    assert set(voices["voice_aliases"].values()) <= set(voices["voices"])


def test_default_name_default_voice_and_no_aliases():
    """--model as typed (relative, trailing slash) → served as the folder's name; --no-openai-aliases → tts-1 is
    404; --default-voice (an OpenAI name) speaks requests that name no voice."""
    server = ServerProcess("--model", os.path.relpath(FIXTURES / "tiny-custom-voice") + "/", "--no-openai-aliases",
                           "--default-voice", "alloy")
    try:
        assert [m["id"] for m in json.loads(request(server.url + "/v1/models")[2])["data"]] == ["tiny-custom-voice"]
        document = json.loads(request(server.url + "/openapi.json")[2])
        assert document["components"]["schemas"]["SpeechRequest"]["properties"]["model"]["anyOf"][0]["enum"] == [
            "tiny-custom-voice"]
        status, _, body = request(server.url + "/v1/audio/speech", dict(OK, model="tts-1"))
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
        expected = offline_pcm("tiny-custom-voice", text="No voice given.", voice="vivian")
        status, _, pcm = request(server.url + "/v1/audio/speech", dict(
            GREEDY, model="tiny-custom-voice", input="No voice given.", response_format="pcm"))
        assert status == 200
        assert_pcm_close(pcm, expected)
    finally:
        server.stop()


def test_a_default_voice_the_checkpoint_lacks_stops_the_start():
    """Refused from the checkpoint's config before any stage starts: one line (the voices available), status 2."""
    for checkpoint, flag, message in (
            ("tiny-custom-voice", "nobody", "--default-voice 'nobody' is not a voice of this checkpoint; available: "
                                            "aiden, dylan, eric, ono_anna, ryan, serena, sohee, uncle_fu, vivian, or an "
                                            "alias (OpenAI's, ElevenLabs' and DashScope's voice names"),
            ("tiny-voice-design", "alloy", "--default-voice needs a CustomVoice")):
        done = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--model",
                               str(FIXTURES / checkpoint), "--default-voice", flag, "--port", str(free_port())],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        assert done.returncode == 2, done.stdout
        assert done.stdout.startswith(f"omni-tts serve: error: {message}") and done.stdout.count("\n") == 1, \
            done.stdout


@pytest.mark.parametrize("variant,kwargs", [
    ("tiny-voice-design", {"input": "Designed voice.", "instructions": "A calm, deep voice.", "language": "english"}),
])
def test_voice_design_parity_streaming_and_not(variant, kwargs):
    server = ServerProcess("--model", str(FIXTURES / variant), "--served-model-name", MODEL)
    try:
        expected = offline_pcm(variant, text=kwargs["input"], instructions=kwargs["instructions"],
                               language=kwargs["language"])
        payload = dict(GREEDY, model=MODEL, response_format="pcm", **kwargs)
        for extra in ({}, {"stream_format": "audio"}):
            status, _, body = request(server.url + "/v1/audio/speech", dict(payload, **extra))
            assert status == 200
            assert_pcm_close(body, expected)
        # the openai SDK always sends a voice: ignored, and said so, whole or streamed
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        sdk_args = dict(model="tts-1", voice="alloy", input=kwargs["input"], instructions=kwargs["instructions"],
                        response_format="pcm", extra_body=dict(GREEDY, language=kwargs["language"]))
        response = client.audio.speech.with_raw_response.create(**sdk_args)
        assert response.headers["x-omni-tts-voice-ignored"] == "alloy"
        assert_pcm_close(response.content, expected)
        with client.audio.speech.with_streaming_response.create(**sdk_args, stream_format="audio") as streamed:
            assert streamed.headers["x-omni-tts-voice-ignored"] == "alloy"
            assert_pcm_close(streamed.read(), expected)
    finally:
        server.stop()


def test_voice_clone_by_ref_audio_and_uploaded_voice(base_server):
    expected = offline_pcm("tiny-base", text="Clone me.", ref_audio=str(REF_WAV), ref_text=REF_TEXT, language="english")
    data_uri = "data:audio/wav;base64," + base64.b64encode(REF_WAV.read_bytes()).decode()
    payload = dict(GREEDY, model=MODEL, input="Clone me.", language="english", response_format="pcm")
    for extra in ({}, {"stream_format": "audio"}):
        status, _, body = request(base_server.url + "/v1/audio/speech",
                                  dict(payload, ref_audio=data_uri, ref_text=REF_TEXT, **extra))
        assert status == 200, body[:300]
        assert_pcm_close(body, expected)
    status, _, body = request(base_server.url + "/v1/audio/speech",
                              dict(payload, ref_audio=str(REF_WAV), ref_text=REF_TEXT))  # allow-listed local file
    assert status == 200
    assert_pcm_close(body, expected)
    # upload the clip as a voice, then use it by name
    assert upload_voice(base_server, "fox", REF_WAV.read_bytes(), ref_text=REF_TEXT, consent="yes")["name"] == "fox"
    status, _, listing = request(base_server.url + "/v1/audio/voices")
    assert "fox" in json.loads(listing)["voices"]
    status, _, pcm = request(base_server.url + "/v1/audio/speech", dict(payload, voice="fox"))
    assert status == 200
    assert_pcm_close(pcm, expected)
    assert request(base_server.url + "/v1/audio/voices/fox", method="DELETE")[0] == 200
    status, _, error = request(base_server.url + "/v1/audio/speech", dict(payload, voice="fox"))
    assert status == 400 and "unknown voice 'fox'" in json.loads(error)["error"]["message"]


def test_replicas_on_one_voices_dir_share_uploads_replacements_and_deletes(base_server):
    """A second server on base_server's --voices-dir, as a replica behind a balancer: what is uploaded, replaced or
    deleted through one is used, updated or gone on the other at its next request, and speaks the same (greedy)."""
    other = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL, "--voices-dir",
                          str(base_server.voices_dir))
    payload = dict(GREEDY, model=MODEL, input="Clone me.", language="english", response_format="pcm",
                   voice="shared-fox")

    def speak(server):
        status, _, pcm = request(server.url + "/v1/audio/speech", payload)
        assert status == 200, pcm[:300]
        return np.frombuffer(pcm, dtype="<i2")

    def listed(server):
        return {v["name"]: v["created_at"] for v in json.loads(request(server.url + "/v1/audio/voices")[2])["data"]}

    try:
        first = upload_voice(base_server, "Shared-Fox", REF_WAV.read_bytes(), ref_text=REF_TEXT)
        assert listed(other)["Shared-Fox"] == first["created_at"]
        spoken = speak(base_server)
        assert_pcm_close(speak(other).tobytes(), spoken)
        # replaced through the first: the other speaks the new version (another clip, no transcript), not its cache
        second = upload_voice(base_server, "shared-fox", (FIXTURES / "ref_voice_22k.wav").read_bytes())
        assert listed(other)["shared-fox"] == second["created_at"] > first["created_at"]
        respoken = speak(other)
        assert respoken.shape != spoken.shape or np.abs(respoken.astype(int) - spoken).max() > 1
        assert_pcm_close(respoken.tobytes(), speak(base_server))
        # deleted through the first: gone on the other
        assert request(base_server.url + "/v1/audio/voices/shared-fox", method="DELETE")[0] == 200
        status, _, error = request(other.url + "/v1/audio/speech", payload)
        assert status == 400 and "unknown voice 'shared-fox'" in json.loads(error)["error"]["message"]
        assert request(other.url + "/v1/audio/voices/shared-fox", method="DELETE")[0] == 404
        assert "shared-fox" not in listed(other) and "Shared-Fox" not in listed(other)
        # and the other way round
        owl = upload_voice(other, "shared-owl", REF_WAV.read_bytes())
        assert listed(base_server)["shared-owl"] == owl["created_at"] > second["created_at"]
        assert request(base_server.url + "/v1/audio/voices/shared-owl", method="DELETE")[0] == 200
        assert "shared-owl" not in listed(other) and not (base_server.voices_dir / "shared-owl").exists()
    finally:
        other.stop()


def test_openai_sdk_voices_create_list_use_delete(base_server):
    """client.audio.voices.create / delete return populated SDK objects; the listing (a raw GET through the SDK: it
    has no list method) parses as SDK voices; the voice speaks by id; deleting removes the clip from disk."""
    client = openai.OpenAI(base_url=base_server.url + "/v1", api_key="unused")
    with open(REF_WAV, "rb") as clip:
        voice = client.audio.voices.create(name="Sdk-Voice", audio_sample=clip, consent="consent-1")
    assert isinstance(voice, Voice)
    assert (voice.id, voice.name, voice.object, voice.type) == ("Sdk-Voice", "Sdk-Voice", "audio.voice",
                                                                "audio_sample")
    assert isinstance(voice.created_at, int) and abs(voice.created_at - time.time()) < 60
    folder = base_server.voices_dir / "sdk-voice"
    clips = [p for p in folder.iterdir() if p.name.startswith("clip-")]
    assert len(clips) == 1 and clips[0].read_bytes() == REF_WAV.read_bytes()
    with open(REF_WAV, "rb") as clip:  # a re-upload is a new version of the voice
        again = client.audio.voices.create(name="sdk-voice", audio_sample=clip, consent="consent-1")
    assert again.created_at > voice.created_at
    listing = client.get("/audio/voices", cast_to=object)
    listed = [Voice.model_validate(v) for v in listing["data"]]
    assert [(v.id, v.created_at) for v in listed if v.id.lower() == "sdk-voice"] == [("sdk-voice", again.created_at)]
    assert listing["uploaded_voices"] == listing["data"] and "sdk-voice" in listing["voices"]

    payload = dict(model="tts-1", input="Clone me.", response_format="pcm")
    no_transcript = offline_pcm("tiny-base", text="Clone me.", ref_audio=str(REF_WAV), x_vector_only=True,
                                language="english")
    speech = client.audio.speech.create(voice={"id": "sdk-voice"}, extra_body=dict(GREEDY, language="english"),
                                        **payload)
    assert_pcm_close(speech.content, no_transcript)
    # beside ref_audio, the voice the SDK insists on is ignored, and said so
    with_transcript = offline_pcm("tiny-base", text="Clone me.", ref_audio=str(REF_WAV), ref_text=REF_TEXT,
                                  language="english")
    cloned = client.audio.speech.with_raw_response.create(voice="alloy", extra_body=dict(
        GREEDY, language="english", ref_audio=str(REF_WAV), ref_text=REF_TEXT), **payload)
    assert cloned.headers["x-omni-tts-voice-ignored"] == "alloy"
    assert_pcm_close(cloned.content, with_transcript)

    deleted = client.audio.voices.delete("SDK-VOICE")
    assert isinstance(deleted, VoiceDeleted)
    assert (deleted.id, deleted.deleted, deleted.object) == ("sdk-voice", True, "audio.voice.deleted")
    assert not folder.exists()
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete("sdk-voice")


def test_health_models_metrics(cv_server):
    status, _, body = request(cv_server.url + "/health")
    assert status == 200 and json.loads(body) == {"status": "healthy"}
    status, _, body = request(cv_server.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    for entry in json.loads(body)["data"]:  # what a request may ask of the checkpoint (the playground reads it)
        assert entry["task_type"] == "CustomVoice"
        assert entry["languages"][0] == "auto" and "english" in entry["languages"]
        assert entry["random_weights"] is False  # a checkpoint given by --model (the embedded one: test_cli.py)
    status, _, body = request(cv_server.url + "/metrics")
    assert status == 200 and "omni_tts_requests_total" in body.decode()  # the families: test_metrics.py


def test_ready_line_access_log_and_version(cv_server):
    """The ready line names the model, the served name, the URL and each stage; every request gets an access-log
    line under its X-Request-Id (speech: audio seconds and time to first audio), which never holds the text."""
    text = "Quartz zebras whisper seventeen secrets."
    status, headers, body = request(cv_server.url + "/v1/audio/speech", dict(GREEDY, model=MODEL, voice="ryan",
                                                                              input=text, response_format="pcm"))
    assert status == 200
    seconds = len(body) / 2 / 24000
    status, version_headers, version = request(cv_server.url + "/version")
    assert status == 200 and json.loads(version) == {"version": importlib.metadata.version("omni_tts")}
    speech_line = f'{headers["X-Request-Id"]} 127.0.0.1 "POST /v1/audio/speech" 200 '
    version_line = f'{version_headers["X-Request-Id"]} 127.0.0.1 "GET /version" 200 '
    # a line is written once its response has gone out
    output = eventually(lambda: version_line in (out := cv_server.output()) and out, what="the access-log line")
    ready = next(line for line in output.splitlines() if " ready: " in line)
    threads = {stage: f"{n} torch thread{'s' if n > 1 else ''}"
               for stage, n in stage_threads(load_stage_config("cpu_tiny")).items()}
    assert (f"ready: serving {FIXTURES / 'tiny-custom-voice'} as '{MODEL}' at {cv_server.url}; "
            f"talker on cpu (float32, max batch 32, {threads['talker']}); "
            f"code2wav on cpu (float32, max batch 32, {threads['code2wav']})") in ready
    assert "noise" not in ready and "random weights" not in ready  # said of the embedded model only (test_cli.py)
    access = next(line for line in output.splitlines() if speech_line in line)
    assert f" audio={seconds:.3f}s ttfp=" in access and " INFO omni_tts.access: " in access
    assert version_line in output
    assert text not in output and "Quartz" not in output


OK = dict(model=MODEL, input="Hello.", voice="ryan", response_format="pcm")
BAD_REQUESTS = [
    ("empty body", None, 400, "request body is empty"),
    ("not json", b"{nope", 400, "not valid JSON"),
    ("missing input", {k: v for k, v in OK.items() if k != "input"}, 400, "missing required field 'input'"),
    ("speaker and voice differ", dict(OK, speaker="vivian"), 400, "'speaker' is another name for 'voice'"),
    ("empty input", dict(OK, input="   "), 400, "input must not be empty"),
    ("input too long", dict(OK, input="a" * 200_001), 400, "this server takes at most 200000"),
    ("wrong model", dict(OK, model="whisper-1"), 404, "model 'whisper-1' is not served"),
    ("unknown voice", dict(OK, voice="nobody"), 400, "unknown voice 'nobody'"),
    ("voice object unknown", dict(OK, voice={"id": "nobody"}), 400, "unknown voice 'nobody'"),
    ("bad response_format", dict(OK, response_format="ogg"), 400, "invalid 'response_format'"),
    ("speed too low", dict(OK, speed=0.1), 400, "invalid 'speed'"),
    ("speed too high", dict(OK, speed=5), 400, "invalid 'speed'"),
    ("speed with streaming", dict(OK, speed=1.5, stream=True), 400, "speed must be 1.0 for streaming"),
    ("bad stream_format", dict(OK, stream_format="chunks"), 400, "invalid 'stream_format'"),
    ("wrong task type", dict(OK, task_type="Base"), 400, "does not match the loaded CustomVoice"),
    ("unknown task type", dict(OK, task_type="Music"), 400, "invalid 'task_type'"),
    ("unknown language", dict(OK, language="klingon"), 400, "unsupported language 'klingon'"),
    ("temperature negative", dict(OK, temperature=-1), 400, "invalid 'temperature'"),
    ("top_p zero", dict(OK, top_p=0), 400, "invalid 'top_p'"),
    ("top_k string", dict(OK, top_k="ten"), 400, "invalid 'top_k'"),
    ("max_new_tokens too big", dict(OK, max_new_tokens=100000), 400, "invalid 'max_new_tokens'"),
    ("seed negative", dict(OK, seed=-5), 400, "invalid 'seed'"),
    ("repetition_penalty zero", dict(OK, repetition_penalty=0), 400, "invalid 'repetition_penalty'"),
    ("initial chunk zero", dict(OK, initial_codec_chunk_frames=0), 400, "invalid 'initial_codec_chunk_frames'"),
    ("ref_audio on CustomVoice", dict(OK, ref_audio="data:audio/wav;base64,AAAA"), 400, "only supported by Base"),
    ("x_vector_only not bool", dict(OK, x_vector_only_mode="yes"), 400, "invalid 'x_vector_only_mode'"),
]


@pytest.mark.parametrize("name,payload,status,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests(cv_server, name, payload, status, message):
    data = payload if isinstance(payload, bytes) else (b"" if payload is None else json.dumps(payload).encode())
    got, _, body = request(cv_server.url + "/v1/audio/speech", data=data, headers={"Content-Type": "application/json"})
    error = json.loads(body)["error"]
    assert got == status, (got, error)
    assert message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert request(cv_server.url + "/health")[0] == 200  # still serving


BASE_BAD = [
    ("no reference", dict(model=MODEL, input="Hi."), 400, "need ref_audio"),
    ("bad base64", dict(model=MODEL, input="Hi.", ref_audio="data:audio/wav;base64,!!!notbase64", x_vector_only_mode=True), 400, "ref_audio"),
    ("not audio", dict(model=MODEL, input="Hi.", ref_audio="data:audio/wav;base64," + base64.b64encode(b"hello" * 100).decode(), x_vector_only_mode=True), 400, "ref_audio"),
    ("local file outside allow-list", dict(model=MODEL, input="Hi.", ref_audio="/etc/passwd", x_vector_only_mode=True), 400, "ref_audio"),
    ("icl without ref_text", dict(model=MODEL, input="Hi.", ref_audio=str(REF_WAV)), 400, "ref_text is required"),
    ("instructions on Base", dict(model=MODEL, input="Hi.", ref_audio=str(REF_WAV), x_vector_only_mode=True, instructions="Loud."), 400, "instructions are not supported"),
]


@pytest.mark.parametrize("name,payload,status,message", BASE_BAD, ids=[b[0] for b in BASE_BAD])
def test_bad_voice_clone_requests(base_server, name, payload, status, message):
    got, _, body = request(base_server.url + "/v1/audio/speech", dict(payload, response_format="pcm"))
    error = json.loads(body)["error"]
    assert got == status and message in error["message"], (got, error)
    assert error["param"] in ("ref_audio", "ref_text", "voice", "instructions")


def _metric(server, name):
    text = request(server.url + "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_full_queue_is_429_and_disconnect_aborts_everywhere():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--max-queue", "1")
    try:
        long_request = dict(model=MODEL, voice="ryan", input=RUNS_TO_ITS_LIMIT, response_format="pcm", stream_format="audio",
                            temperature=0, repetition_penalty=1.0, max_new_tokens=2000)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/audio/speech", json.dumps(long_request), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and len(response.read(3840)) == 3840  # streaming has started
        # the stages paused at its first audio: it cannot end (191 frames) until the test resumes them
        stages = stage_pids(server.proc.pid)
        for pid in stages:
            os.kill(pid, signal.SIGSTOP)
        try:
            status, headers, body = request(server.url + "/v1/audio/speech", dict(long_request, stream=False))
            assert status == 429 and headers.get("Retry-After") == "1"
            assert json.loads(body)["error"]["type"] == "rate_limit_error"
            conn.close()  # the client goes away mid-stream
        finally:
            for pid in stages:
                os.kill(pid, signal.SIGCONT)
        eventually(lambda: not (_metric(server, "omni_tts_stage_requests") or _metric(server, "omni_tts_in_flight")),
                   what="the stages and admission holding nothing")
        assert request(server.url + "/v1/audio/speech", dict(long_request, max_new_tokens=10))[0] == 200
    finally:
        server.stop()



@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("stream_format", ["audio", "sse"])
async def test_a_stream_the_client_leaves_closes_its_encoder(in_process_app, stream_format):
    import gc

    import aiohttp

    from server_util import unclosed_codec_containers

    def aborted() -> float:
        return state.metrics.registry.get_sample_value("omni_tts_requests_total", {"status": "abort"}) or 0

    url, state = in_process_app
    aborts = aborted()
    gc.collect()
    gc.disable()  # what the GC would free late must still be there to be seen
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "voice": "ryan", "input": RUNS_TO_ITS_LIMIT, "response_format": "mp3",
                    "stream": True, "stream_format": stream_format, "temperature": 0}
            response = await http.post(url + "/v1/audio/speech", json=body)
            assert response.status == 200 and await response.content.readany()
            response.close()  # the client goes away mid-stream
        await eventually_async(lambda: not state.admitted, what="the stream's slot freed")
        assert aborted() == aborts + 1
        assert unclosed_codec_containers() == []
    finally:
        gc.enable()


def test_one_mapping_from_engine_errors_to_statuses():
    from omni_tts.entrypoints.api.errors import api_error
    from omni_tts.entrypoints.api.schema import ApiError
    from omni_tts.models.qwen3_tts.prompt import RequestError
    from omni_tts.orchestrator.types import RequestFailed, RequestTimedOut, StageDeadError

    cases = [
        (RequestError("voice", "unknown voice"), 400, "unknown voice", "invalid_request"),
        (StageDeadError("stage talker failed"), 503, "stage talker failed", "service_unavailable"),
        (RequestTimedOut("no audio within 2 s", before_first_audio=True), 503,
         "the server is overloaded: no audio within 2 s; retry shortly", "service_unavailable"),
        (RequestTimedOut("the speech did not finish within 9 s", before_first_audio=False), 504,
         "the speech did not finish within 9 s", "server_error"),
        (RequestFailed("code2wav cannot decode"), 500, "speech generation failed: code2wav cannot decode",
         "server_error"),
    ]
    for error, status, message, code in cases:
        mapped = api_error(error)
        assert (mapped.status, mapped.message, mapped.code) == (status, message, code), error
    assert api_error(RequestError("voice", "x")).param == "voice"
    own = ApiError(429, "busy")
    assert api_error(own) is own


def test_word_timestamps_without_an_aligner_is_a_400(cv_server):
    """A server started with --model and no --forced-aligner has none: the request is refused, not answered without."""
    status, _, body = request(cv_server.url + "/v1/audio/speech", {"input": "Hi.", "word_timestamps": True})
    assert status == 400 and json.loads(body)["error"]["param"] == "word_timestamps"
    assert "aligner" not in json.loads(request(cv_server.url + "/health")[2])
