"""`speaker_embedding`, the voice as the speaker encoder's x-vector, over real sockets on the tiny Base checkpoint
(greedy): the vector GET /v1/audio/voices/{name}/embedding gives for a clip voice speaks exactly as the clip does in
x-vector-only mode, over HTTP and the WebSocket; a voice uploaded as an embedding speaks the same; bad vectors and
bad combinations are one-line 400s naming the field; the listing shows embedding voices and descriptions."""
import asyncio
import json

import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.engine.offline import synthesize
from omni_tts.voices.store import VoiceStore
from omni_tts.models.qwen3_tts.audio import load_audio
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.models.qwen3_tts.speaker_encoder import extract_speaker_embedding
from server_util import MODEL, ServerProcess, request, ws_utterance

GREEDY = {"temperature": 0, "max_new_tokens": 24}
REF_WAV = FIXTURES / "ref_voice.wav"
CLIP = REF_WAV.read_bytes()
DIM = Qwen3TTSConfig.load(str(FIXTURES / "tiny-base")).speaker_encoder.enc_dim   # the tiny fixture's: 64
TEXT = "An embedding is a voice too."
BOUNDARY = "embeddingboundary"


def speak(server: ServerProcess, **fields) -> tuple[int, dict, bytes]:
    body = dict(GREEDY, model=MODEL, input=TEXT, response_format="pcm", language="english", **fields)
    return request(server.url + "/v1/audio/speech", body)


def pcm(server: ServerProcess, **fields) -> bytes:
    status, _, body = speak(server, **fields)
    assert status == 200, body[:300]
    assert len(body) > 0
    return body


def upload(server: ServerProcess, name: str, clip: bytes | None = None, **fields: str) -> tuple[int, dict]:
    """POST /v1/audio/voices as a multipart form: text fields, and the clip as a file when given."""
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'.encode() + value.encode()
             + b"\r\n" for key, value in dict(fields, name=name).items()]
    if clip is not None:
        parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="audio_sample"; filename="v.wav"\r\n'
                     "Content-Type: audio/wav\r\n\r\n".encode() + clip + b"\r\n")
    status, _, answer = request(server.url + "/v1/audio/voices", data=b"".join(parts) + f"--{BOUNDARY}--\r\n".encode(),
                                headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    return status, json.loads(answer)


def embedding_of(server: ServerProcess, name: str) -> dict:
    status, _, body = request(f"{server.url}/v1/audio/voices/{name}/embedding")
    assert status == 200, body[:300]
    return json.loads(body)


def assert_one_line_400(answer: tuple[int, dict], param: str, says: str) -> None:
    status, body = answer
    error = body["error"]
    assert status == 400 and error["param"] == param and says in error["message"], (status, error)
    assert "\n" not in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_a_clip_voices_embedding_speaks_as_its_clip(base_server):
    status, voice = upload(base_server, "Fox", CLIP, speaker_description="a calm narrator")
    assert status == 200 and voice["embedding_source"] == "audio" and voice["embedding_dim"] == DIM
    first = embedding_of(base_server, "fox")
    assert (first["name"], first["embedding_source"], first["embedding_dim"]) == ("Fox", "audio", DIM)
    vector = first["speaker_embedding"]
    assert len(vector) == DIM and embedding_of(base_server, "FOX")["speaker_embedding"] == vector
    # the speaker encoder's output for the clip (the server computes it in its talker stage)
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-base"))
    offline = extract_speaker_embedding(tts.speaker_encoder, load_audio(CLIP)[0]).numpy()
    np.testing.assert_allclose(vector, offline, atol=1e-5)

    from_clip = pcm(base_server, ref_audio=str(REF_WAV), x_vector_only_mode=True)
    assert pcm(base_server, speaker_embedding=vector) == from_clip
    assert pcm(base_server, voice="fox") == from_clip   # a clip voice without ref_text: x-vector-only
    # a name that is no uploaded voice is ignored beside the vector, as beside ref_audio, and said so
    status, headers, body = speak(base_server, speaker_embedding=vector, voice="alloy")
    assert status == 200 and body == from_clip and headers["x-omni-tts-voice-ignored"] == "alloy"
    # the vector is the voice: another vector speaks otherwise
    assert pcm(base_server, speaker_embedding=[v * 0.5 for v in vector]) != from_clip


def test_a_voice_uploaded_as_an_embedding_speaks_the_same(base_server):
    upload(base_server, "clip-voice", CLIP)
    vector = embedding_of(base_server, "clip-voice")["speaker_embedding"]
    status, answer = upload(base_server, "Vec", speaker_embedding=json.dumps(vector), consent="ok",
                            speaker_description="mixed from two voices")
    assert status == 200 and answer["success"], answer
    voice = answer["voice"]
    assert (voice["type"], voice["embedding_source"], voice["embedding_dim"]) == ("speaker_embedding", "embedding",
                                                                                   DIM)
    assert voice["speaker_description"] == "mixed from two voices" and voice["duration_s"] is None
    assert embedding_of(base_server, "vec") == {"object": "audio.voice.embedding", "name": "Vec",
                                                "created_at": voice["created_at"], "embedding_source": "embedding",
                                                "embedding_dim": DIM, "speaker_embedding": vector}
    assert pcm(base_server, voice="vec") == pcm(base_server, ref_audio=str(REF_WAV), x_vector_only_mode=True)

    listing = json.loads(request(base_server.url + "/v1/audio/voices")[2])
    listed = {v["name"]: v for v in listing["uploaded_voices"]}
    assert {"Vec", "clip-voice"} <= set(listed) and "Vec" in listing["voices"]
    assert listed["Vec"] == voice
    assert (listed["clip-voice"]["embedding_source"], listed["clip-voice"]["embedding_dim"]) == ("audio", DIM)
    # an embedding voice has no clip to clone in-context
    status, _, body = speak(base_server, voice="vec", ref_text="A transcript.")
    assert_one_line_400((status, json.loads(body)), "voice", "ref_text")


async def ws_pcm(server: ServerProcess, **config) -> bytes:
    """One utterance of TEXT over WS /v1/audio/speech/stream (token mode): its PCM."""
    audio, events = await ws_utterance(server.url, [
        dict(GREEDY, type="session.config", response_format="pcm", language="english", stream_audio=True, **config),
        {"type": "input.text", "text": TEXT}, {"type": "input.done"}])
    assert events[-1]["type"] == "session.done", events
    return audio


async def ws_error(server: ServerProcess, **config) -> str:
    _, events = await ws_utterance(server.url, [dict(type="session.config", response_format="pcm", **config)])
    assert events[-1]["type"] == "error", events
    return events[-1]["message"]


def test_websocket_session_config_takes_an_embedding(base_server):
    upload(base_server, "ws-voice", CLIP)
    vector = embedding_of(base_server, "ws-voice")["speaker_embedding"]

    async def main():
        from_clip = await ws_pcm(base_server, ref_audio=str(REF_WAV), x_vector_only_mode=True)
        assert len(from_clip) > 0 and await ws_pcm(base_server, speaker_embedding=vector) == from_clip
        assert "speaker_embedding" in await ws_error(base_server, speaker_embedding=vector[:-1])
        assert "speaker_embedding" in await ws_error(base_server, speaker_embedding=vector, ref_text="Hi.")
    asyncio.run(main())


def test_bad_embeddings_are_one_line_400s_naming_the_field(base_server):
    upload(base_server, "bad-voice", CLIP)
    good = embedding_of(base_server, "bad-voice")["speaker_embedding"]

    def refused(body: bytes) -> tuple[int, dict]:
        status, _, answer = request(base_server.url + "/v1/audio/speech", data=body,
                                    headers={"Content-Type": "application/json"})
        return status, json.loads(answer)

    def fields(**changes) -> bytes:
        return json.dumps(dict(GREEDY, model=MODEL, input=TEXT, response_format="pcm", **changes)).encode()

    assert_one_line_400(refused(fields(speaker_embedding=good[:-1])), "speaker_embedding", f"list of {DIM} numbers")
    assert_one_line_400(refused(fields(speaker_embedding=good + [0.0])), "speaker_embedding", f"{DIM} numbers")
    assert_one_line_400(refused(fields(speaker_embedding=[])), "speaker_embedding", f"{DIM} numbers")
    # json.dumps writes NaN and Infinity for non-finite floats; JSON has no such numbers
    assert_one_line_400(refused(fields(speaker_embedding=[float("nan")] + good[1:])), "speaker_embedding", "finite")
    assert_one_line_400(refused(fields(speaker_embedding=[float("inf")] + good[1:])), "speaker_embedding", "finite")
    assert_one_line_400(refused(fields(speaker_embedding=good[:-1]).replace(b"]", b", 1e999]", 1)),
                        "speaker_embedding", "out of range")
    assert_one_line_400(refused(fields(speaker_embedding=[2e3] + good[1:])), "speaker_embedding", "within ±1000")
    assert_one_line_400(refused(fields(speaker_embedding=["a"] * DIM)), "speaker_embedding", "float")
    assert_one_line_400(refused(fields(speaker_embedding=good, ref_audio=str(REF_WAV))), "speaker_embedding",
                        "ref_audio")
    assert_one_line_400(refused(fields(speaker_embedding=good, ref_text="A transcript.")), "speaker_embedding",
                        "ref_text")
    assert_one_line_400(refused(fields(speaker_embedding=good, voice="bad-voice")), "voice", "speaker_embedding")
    # uploads: an embedding is checked as a request's is; a voice is a clip or a vector, one of them
    assert_one_line_400(upload(base_server, "x", speaker_embedding=json.dumps(good[:-1])), "speaker_embedding",
                        f"{DIM} numbers")
    assert_one_line_400(upload(base_server, "x", speaker_embedding=json.dumps([float("nan")] + good[1:])),
                        "speaker_embedding", "finite")
    assert_one_line_400(upload(base_server, "x", speaker_embedding="[1, 2"), "speaker_embedding", "JSON list")
    assert_one_line_400(upload(base_server, "x", speaker_embedding=json.dumps(good), ref_text="Hi."),
                        "speaker_embedding", "ref_text")
    assert_one_line_400(upload(base_server, "x", CLIP, speaker_embedding=json.dumps(good)), "speaker_embedding",
                        "not both")
    assert_one_line_400(upload(base_server, "x", CLIP, speaker_description="d" * 1025), "speaker_description",
                        "1024")
    assert request(base_server.url + "/v1/audio/voices/x/embedding")[0] == 404
    assert "x" not in json.loads(request(base_server.url + "/v1/audio/voices")[2])["voices"]


def test_custom_voice_checkpoints_refuse_an_embedding(cv_server):
    status, _, body = speak(cv_server, speaker_embedding=[0.0] * DIM)
    assert_one_line_400((status, json.loads(body)), "speaker_embedding", "only supported by Base")


def test_the_store_keeps_an_embedding_voice_across_restarts(tmp_path):
    vector = np.linspace(-1, 1, DIM, dtype=np.float32)
    record = VoiceStore(str(tmp_path)).add_embedding("Mix", vector, "yes", "two voices, averaged")
    assert (record.embedding_dim, record.embedding_source, record.file_size) == (DIM, "embedding", 4 * DIM)
    again = VoiceStore(str(tmp_path))   # a restart: everything from disk
    loaded, stored = again.load("mix")
    assert loaded == record and stored.dtype == np.float32 and not stored.flags.writeable
    np.testing.assert_array_equal(stored, vector)
    assert [v.name for v in again.list()] == ["Mix"] and again.list()[0].speaker_description == "two voices, averaged"
    replaced = again.add("mix", CLIP, None, None)   # a clip replaces it, and its file leaves at once
    assert replaced.embedding_dim is None and sorted(p.name.split("-")[0] for p in (tmp_path / "mix").iterdir()) == [
        "clip", "meta.json"]


def test_offline_synthesis_takes_an_embedding():
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-base"))
    vector = extract_speaker_embedding(tts.speaker_encoder, load_audio(CLIP)[0]).numpy()

    def audio(**voice) -> np.ndarray:
        return synthesize(tts, [SynthesisRequest(text=TEXT, sampling=SamplingParams(**GREEDY), **voice)])[0].audio
    np.testing.assert_array_equal(audio(speaker_embedding=vector.tolist()),
                                  audio(ref_audio=str(REF_WAV), x_vector_only=True))
    with pytest.raises(RequestError, match="finite") as error:
        audio(speaker_embedding=[float("nan")] * DIM)
    assert error.value.param == "speaker_embedding"
