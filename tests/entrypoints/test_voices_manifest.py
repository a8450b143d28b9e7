"""--voices-manifest against a real server on loopback: its voices are listed with the uploaded ones, speak as the
same clip sent as ref_audio does, and cannot be replaced or deleted; a bad manifest stops the start with one line
naming the entry, exit status 2."""
import base64
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from conftest import FIXTURES
from server_util import ServerProcess, free_port, request
from test_server import GREEDY, MODEL, REF_TEXT, REF_WAV, assert_pcm_close, upload_voice

REF_22K = FIXTURES / "ref_voice_22k.wav"
TEXT = "A voice prepared offline."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("manifest")
    (folder / "clips").mkdir()
    shutil.copy(REF_WAV, folder / "clips" / "narrator.wav")
    shutil.copy(REF_22K, folder / "clips" / "plain.wav")
    # YAML here; the bad manifests below are JSON
    (folder / "voices.yaml").write_text(
        "voices:\n"
        f"  - name: Narrator\n    audio: clips/narrator.wav\n    ref_text: {json.dumps(REF_TEXT)}\n"
        "    consent: recorded with the speaker's written consent\n"
        "  - name: plain\n    audio: clips/plain.wav\n")
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL,
                           "--voices-manifest", str(folder / "voices.yaml"),
                           "--voices-dir", str(tmp_path_factory.mktemp("voices")))
    yield server
    server.stop()


def speech(server, payload):
    return request(server.url + "/v1/audio/speech", dict(GREEDY, response_format="pcm", input=TEXT, **payload))


def data_uri(path) -> str:
    return "data:audio/wav;base64," + base64.b64encode(path.read_bytes()).decode()


def test_manifest_voices_are_listed_beside_uploaded_ones(server):
    upload_voice(server, "uploaded", REF_WAV.read_bytes(), ref_text=REF_TEXT)
    status, _, body = request(server.url + "/v1/audio/voices")
    assert status == 200
    listing = json.loads(body)
    assert listing["voices"] == ["Narrator", "plain", "uploaded"]
    voices = {v["name"]: v for v in listing["uploaded_voices"]}
    assert voices["Narrator"]["read_only"] is True and voices["plain"]["read_only"] is True
    assert "read_only" not in voices["uploaded"]
    assert voices["Narrator"]["ref_text"] == REF_TEXT and voices["plain"]["ref_text"] is None
    assert voices["Narrator"]["consent"] == "recorded with the speaker's written consent"
    assert voices["Narrator"]["file_size"] == REF_WAV.stat().st_size


def test_a_manifest_voice_speaks_as_its_clip_sent_as_ref_audio(server):
    status, _, clone = speech(server, {"ref_audio": data_uri(REF_WAV), "ref_text": REF_TEXT})
    assert status == 200
    status, _, voice = speech(server, {"voice": "narrator"})  # any case, as uploaded voices
    assert status == 200, voice[:300]
    assert_pcm_close(voice, np.frombuffer(clone, "<i2"))
    # no ref_text: x-vector cloning, as the clip sent alone in that mode
    status, _, clone = speech(server, {"ref_audio": data_uri(REF_22K), "x_vector_only_mode": True})
    assert status == 200
    status, _, voice = speech(server, {"voice": "plain"})
    assert status == 200
    assert_pcm_close(voice, np.frombuffer(clone, "<i2"))


def test_a_manifest_voice_cannot_be_deleted_or_replaced(server):
    status, _, body = request(server.url + "/v1/audio/voices/NARRATOR", method="DELETE")
    error = json.loads(body)["error"]
    assert status == 409 and "read-only" in error["message"] and "--voices-manifest" in error["message"], error
    boundary = "b0undary"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nnarrator\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"audio_sample\"; filename=\"v.wav\"\r\n"
            "Content-Type: audio/wav\r\n\r\n").encode() + REF_WAV.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    status, _, body = request(server.url + "/v1/audio/voices", data=form,
                              headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 409 and "read-only" in json.loads(body)["error"]["message"]
    assert speech(server, {"voice": "Narrator"})[0] == 200  # still there
    # the uploaded voices behind the manifest are deleted as before
    upload_voice(server, "passing", REF_WAV.read_bytes())
    assert request(server.url + "/v1/audio/voices/passing", method="DELETE")[0] == 200


def test_an_embedding_entry_speaks_as_the_clip_it_was_computed_from(server, tmp_path):
    """A manifest entry holding a speaker embedding (as the GET route gives a manifest clip voice's) speaks what
    that clip voice speaks in x-vector mode (it has no ref_text)."""
    status, _, body = request(server.url + "/v1/audio/voices/plain/embedding")
    assert status == 200
    vector = json.loads(body)["speaker_embedding"]
    status, _, expected = speech(server, {"voice": "plain"})
    assert status == 200
    (tmp_path / "voices.json").write_text(json.dumps({"voices": [
        {"name": "mixed", "embedding": vector, "speaker_description": "a vector prepared offline"}]}))
    embedded = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL,
                             "--voices-manifest", str(tmp_path / "voices.json"))
    try:
        status, _, pcm = speech(embedded, {"voice": "mixed"})
        assert status == 200
        assert_pcm_close(pcm, np.frombuffer(expected, "<i2"))
        (voice,) = json.loads(request(embedded.url + "/v1/audio/voices")[2])["uploaded_voices"]
        assert voice["embedding_source"] == "embedding" and voice["embedding_dim"] == len(vector)
        assert voice["read_only"] is True and voice["speaker_description"] == "a vector prepared offline"
    finally:
        embedded.stop()


def _short_clip(path):
    sf.write(path, np.zeros(12000, np.float32), 24000)  # 0.5 s: under the 1 s an upload needs


BAD_MANIFESTS = [  # (checkpoint, manifest, what the one line says)
    ("tiny-base", {"voices": [{"name": "gone", "audio": "missing.wav"}]},
     "voices[0] ('gone'): cannot read audio 'missing.wav'"),
    ("tiny-base", {"voices": [{"name": "Twice", "audio": "ref.wav"}, {"name": "twice", "audio": "ref.wav"}]},
     "voices[1] ('twice'): the name is given twice"),
    ("tiny-base", {"voices": [{"name": "short", "audio": "short.wav"}]}, "voices[0] ('short'): "),
    ("tiny-base", {"voices": [{"name": "bad/name", "audio": "ref.wav"}]}, "voices[0] ('bad/name'): voice name must"),
    ("tiny-base", {"voices": [{"name": "noclip"}]}, "voices[0] ('noclip'): give one source: audio (a clip) or "
     "embedding"),
    ("tiny-base", {"voices": [{"name": "both", "audio": "ref.wav", "embedding": [0.0] * 64}]},
     "voices[0] ('both'): give one source"),
    ("tiny-base", {"voices": [{"name": "short_vector", "embedding": [0.1] * 3}]},
     "voices[0] ('short_vector'): speaker_embedding must be a list of 64 numbers"),
    ("tiny-custom-voice", {"voices": []}, "manifest voices need a Base (voice clone) checkpoint"),
]


@pytest.mark.parametrize("checkpoint,manifest,message", BAD_MANIFESTS, ids=[m[2][:24] for m in BAD_MANIFESTS])
def test_a_bad_manifest_stops_the_start_with_one_line(tmp_path, checkpoint, manifest, message):
    shutil.copy(REF_WAV, tmp_path / "ref.wav")
    _short_clip(tmp_path / "short.wav")
    (tmp_path / "voices.json").write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--model",
                           str(FIXTURES / checkpoint), "--voices-manifest", str(tmp_path / "voices.json"),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(errors) == 1 and errors[0].startswith("omni-tts serve: error: --voices-manifest "), done.stderr
    assert message in errors[0], errors[0]
