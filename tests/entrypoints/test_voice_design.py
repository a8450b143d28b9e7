"""A voice designed once and kept (issue 36): POST /v1/audio/voices with `type: "prompt"` on a server with the tiny
CustomVoice, VoiceDesign and Base models and a voices dir. The VoiceDesign model speaks the script greedily, the
sample is stored as a Base clip voice with the script as its transcript; its speech equals cloning, by hand, the
sample a /v1/audio/speech request to the designer gives."""
import base64
import io
import json

import openai
import pytest
import soundfile as sf
from openai.types.audio import Voice

from audio_util import assert_same_audio
from conftest import FIXTURES
from server_util import ServerProcess, request
from test_several_models import several_models
from omni_tts.entrypoints.api.voice_design import DEFAULT_SCRIPTS, DESIGN_MAX_NEW_TOKENS, DESIGN_SEED

PROMPT = "A calm, deep voice, slow and warm."
SCRIPT = "Hello there, this is a designed voice."
CLONE = {"input": "Clone me.", "temperature": 0, "max_new_tokens": 24, "language": "english", "response_format": "pcm"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    voices_dir = tmp_path_factory.mktemp("voices")
    server = several_models(tmp_path_factory.mktemp("models") / "models.yaml", "--voices-dir", str(voices_dir))
    server.voices_dir = voices_dir
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def speak(server, body: dict) -> bytes:
    status, _, data = request(server.url + "/v1/audio/speech", body)
    assert status == 200, data
    return data


def wav_samples(wav: bytes) -> bytes:
    """A 16-bit WAV's samples, as raw PCM."""
    samples, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000
    return samples.tobytes()


def test_a_designed_voice_speaks_as_its_sample_cloned_by_hand(server, client):
    voice = client.audio.voices.create(name="Designed", type="prompt", prompt=PROMPT, script_hint=SCRIPT)
    assert isinstance(voice, Voice)
    assert (voice.id, voice.type, voice.prompt) == ("Designed", "prompt", PROMPT)
    # by hand: the designer speaks the script greedily, then the Base model clones that WAV with the script as text
    sample = speak(server, {"model": "designer", "input": SCRIPT, "instructions": PROMPT, "response_format": "wav",
                            "temperature": 0, "seed": DESIGN_SEED, "max_new_tokens": DESIGN_MAX_NEW_TOKENS})
    stored = next(p for p in (server.voices_dir / "designed").iterdir() if p.name.startswith("clip-"))
    assert_same_audio(wav_samples(stored.read_bytes()), wav_samples(sample))
    by_hand = speak(server, CLONE | {"model": "clone", "ref_text": SCRIPT,
                                     "ref_audio": "data:audio/wav;base64," + base64.b64encode(sample).decode()})
    designed = client.audio.speech.create(model="clone", voice={"id": "designed"}, input=CLONE["input"],
                                          response_format="pcm", extra_body={k: CLONE[k] for k in (
                                              "temperature", "max_new_tokens", "language")})
    assert_same_audio(designed.content, by_hand)
    by_name = speak(server, CLONE | {"model": "clone", "voice": "Designed"})
    assert_same_audio(by_name, by_hand)

    listing = json.loads(request(server.url + "/v1/audio/voices")[2])
    listed = next(v for v in listing["data"] if v["id"] == "Designed")
    assert (listed["type"], listed["prompt"], listed["design_model"], listed["ref_text"]) == (
        "prompt", PROMPT, "designer", SCRIPT)
    assert Voice.model_validate(listed).type == "prompt"


def test_json_body_and_the_default_script_in_the_requests_language(server):
    status, _, data = request(server.url + "/v1/audio/voices", {"name": "json-voice", "type": "prompt",
                                                                "prompt": PROMPT, "model": "auto",
                                                                "language": "french"})
    assert status == 200, data
    voice = json.loads(data)
    assert (voice["type"], voice["ref_text"], voice["design_model"]) == ("prompt", DEFAULT_SCRIPTS["french"],
                                                                         "designer")


def test_a_sample_too_short_to_clone_is_refused_naming_the_script(server):
    """The tiny random-weight designer speaks the German default script for 0.88 s: under a clip's 1 s."""
    status, _, data = request(server.url + "/v1/audio/voices", {"name": "short", "type": "prompt", "prompt": PROMPT,
                                                                "language": "german"})
    error = json.loads(data)["error"]
    assert (status, error["param"]) == (400, "script_hint")
    assert error["message"].startswith("the designed sample is too short"), error
    assert "short" not in {v["id"] for v in json.loads(request(server.url + "/v1/audio/voices")[2])["data"]}


@pytest.mark.parametrize("body, param, message", [
    ({"name": "v", "type": "prompt", "prompt": "   "}, "prompt", "prompt must not be blank"),
    ({"name": "v", "type": "prompt", "prompt": "x" * 2001}, "prompt", "invalid 'prompt'"),
    ({"name": "v", "type": "prompt"}, "prompt", "missing required field 'prompt'"),
    ({"name": "v", "type": "prompt", "prompt": PROMPT, "script_hint": " "}, "script_hint",
     "script_hint must not be blank"),
    ({"name": "v", "type": "prompt", "prompt": PROMPT, "model": "clone"}, "model", "not a VoiceDesign model"),
    ({"name": "v", "type": "prompt", "prompt": PROMPT, "language": "klingon"}, "script_hint", "no default script"),
    ({"name": ".v", "type": "prompt", "prompt": PROMPT}, "name", "voice name must be"),
    ({"name": "v", "type": "prompt", "prompt": PROMPT, "script_hint": SCRIPT, "language": "klingon"}, "language",
     "klingon"),
    ({"name": "v", "prompt": PROMPT}, "type", "its type must be 'prompt'"),
    ({"name": "v", "type": "audio_sample", "prompt": PROMPT}, "type", "as multipart/form-data"),
])
def test_prompt_errors_name_the_field(server, body, param, message):
    status, _, data = request(server.url + "/v1/audio/voices", body)
    error = json.loads(data)["error"]
    assert (status, error["param"]) == (400, param) and message in error["message"], error


def test_the_sdks_multipart_prompt_is_checked_the_same(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.voices.create(name="v", type="prompt", prompt=" ")
    assert refused.value.body["param"] == "prompt"


def test_a_server_without_a_voicedesign_model_refuses_prompt_voices(base_server):
    client = openai.OpenAI(base_url=base_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.voices.create(name="v", type="prompt", prompt=PROMPT)
    assert refused.value.body["param"] == "type" and "serves none" in refused.value.body["message"]


def test_a_server_without_a_base_model_refuses_prompt_voices(tmp_path):
    """Nothing could speak the designed voice: refused before the designer speaks."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-voice-design"), "--voices-dir", str(tmp_path))
    try:
        status, _, data = request(server.url + "/v1/audio/voices", {"name": "v", "type": "prompt", "prompt": PROMPT})
        error = json.loads(data)["error"]
        assert (status, error["param"]) == (400, "type") and "Base (voice clone) model" in error["message"]
    finally:
        server.stop()
