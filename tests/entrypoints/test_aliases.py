"""The alias table (api/aliases.py): names other APIs' clients hard-code → our voices and models, the fallback on a
checkpoint without the table's speakers, and a bad `--aliases` file stopping the start in one line. An --aliases file
on a running server: test_elevenlabs.py (its server has the flags)."""
import json
import subprocess
import sys

import pytest

from conftest import FIXTURES
from omni_tts.entrypoints.api.aliases import DEFAULT_VOICE_ALIASES, load_aliases, voice_alias_map
from omni_tts.entrypoints.api.names import VoiceNames
from omni_tts.entrypoints.api.schema import ApiError
from server_util import MODEL, free_port, request

SHORT = {"input": "Hi.", "temperature": 0, "max_new_tokens": 2, "response_format": "pcm"}


def test_the_fallback_counts_through_the_table_on_other_speakers():
    """A checkpoint without the preferred speakers: the i-th alias → the (i mod n)-th speaker, sorted; with them, each
    alias its preferred one; an alias named like a speaker is the speaker."""
    mapping = voice_alias_map(["b", "a"])
    for i, alias in enumerate(DEFAULT_VOICE_ALIASES):
        assert mapping[alias] == "ab"[i % 2]
    released = voice_alias_map(["vivian", "serena", "aiden", "ryan", "uncle_fu", "sohee", "ono_anna", "eric"])
    assert (released["cherry"], released["hpp4j3vqnfwauoo0d1us"], released["rachel"]) == ("vivian", "vivian", "serena")
    assert "eric" not in released
    assert VoiceNames("custom_voice", ["eric", "ryan"]).speaker("Eric") == "eric"


def test_a_base_alias_names_an_uploaded_voice():
    names = VoiceNames("base", [], aliases={"Narrator": "clone-1"})
    assert names.choose("narrator", None, {"clone-1"}.__contains__).uploaded == "clone-1"
    assert names.choose("clone-1", None, {"clone-1"}.__contains__).uploaded == "clone-1"
    with pytest.raises(ApiError, match="unknown voice 'narrator'"):
        names.choose("narrator", None, lambda _: False)


def test_vendor_voice_and_model_names_speak_on_the_speech_route(cv_server):
    """DashScope's Cherry is vivian; ElevenLabs', DashScope's and OpenAI Realtime's model names mean the served model;
    an unknown name is still a 404."""
    status, _, expected = request(cv_server.url + "/v1/audio/speech", SHORT | {"voice": "vivian"})
    assert status == 200
    for model in ("eleven_turbo_v2_5", "Ellipsis", "qwen3-tts-flash-realtime", "gpt-realtime-2.1-mini"):
        status, _, pcm = request(cv_server.url + "/v1/audio/speech", SHORT | {"voice": "Cherry", "model": model})
        assert status == 200 and pcm == expected, model
    status, _, body = request(cv_server.url + "/v1/audio/speech", SHORT | {"model": "eleven_unknown"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


BAD_FILES = [  # (file name, contents, what the one line says after "--aliases FILE: ")
    ("aliases.json", '{"voices": {"narrator": "nobody"}}',
     "voices['narrator']: 'nobody' is not a speaker of this checkpoint; available: vivian, serena"),
    ("aliases.yaml", "models: {house: other-model}\n", "models['house']: 'other-model' is not a served model name"),
    ("aliases.json", '{"voices": {"Vivian": "ryan"}}', "voices['Vivian']: is a name of this server already"),
    ("aliases.json", '{"speakers": {}}', "Object contains unknown field `speakers`"),
    ("missing.json", None, "cannot read it"),
]


@pytest.mark.parametrize("name,contents,message", BAD_FILES, ids=[b[2][:16] for b in BAD_FILES])
def test_a_bad_aliases_file_is_one_line(tmp_path, name, contents, message):
    if contents is not None:
        (tmp_path / name).write_text(contents)
    with pytest.raises(ValueError) as refused:
        load_aliases(str(tmp_path / name), "custom_voice", ["vivian", "serena"], [MODEL])
    assert str(refused.value).startswith(f"--aliases {tmp_path / name}: {message}")
    assert "\n" not in str(refused.value)


def test_a_bad_aliases_file_stops_the_start(tmp_path):
    """Before any stage starts: the CLI's one error line and exit status 2."""
    (tmp_path / "aliases.json").write_text('{"models": {"house": "other-model"}}')
    done = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--model",
                           str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL, "--aliases",
                           str(tmp_path / "aliases.json"), "--port", str(free_port())], capture_output=True,
                          text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert errors == [f"omni-tts serve: error: --aliases {tmp_path / 'aliases.json'}: models['house']: "
                      f"'other-model' is not a served model name; available: {MODEL}"], done.stderr
