"""ElevenLabs' REST API through its official `elevenlabs` SDK, unmodified (`ElevenLabs(base_url=..., api_key=...)`),
against real servers on loopback: the speech routes' audio equals /v1/audio/speech's, the timestamped routes'
characters spell the text, voices, models, instant clones, and bad input in ElevenLabs' error shape."""
import base64
import json
import socket

import pytest
from elevenlabs import ElevenLabs
from elevenlabs.core.api_error import ApiError

from audio_util import assert_same_audio
from conftest import FIXTURES
from server_util import MODEL, ServerProcess, request
from test_server import REF_WAV

ALIGNER = FIXTURES.parent / "qwen3_forced_aligner" / "tiny-forced-aligner"
TEXT = "Hello there. How are you today?"
# over aligned_server's --segment-chars 40: narrated, a request per segment
NARRATED = "The river ran past the old mill at dawn. The miller woke, and the wheel began to turn."
# our sampling fields, which ElevenLabs' body lacks, sent the way its SDK adds fields to a body
GREEDY = {"temperature": 0, "max_new_tokens": 24}
OPTIONS = {"additional_body_parameters": GREEDY}
API_KEY = "el-key"   # aligned_server's --api-key (the shared servers take any)
KEY = {"xi-api-key": API_KEY}


def client(server, api_key: str = API_KEY) -> ElevenLabs:
    return ElevenLabs(base_url=server.url, api_key=api_key)


def speech(server, voice: str, response_format: str, text: str = TEXT, sampling: dict = GREEDY, **fields) -> bytes:
    """/v1/audio/speech's audio: what the ElevenLabs routes must equal."""
    status, _, body = request(server.url + "/v1/audio/speech", {"input": text, "voice": voice,
                                                                "response_format": response_format} | sampling | fields,
                              headers={"Content-Type": "application/json"} | KEY)
    assert status == 200, body[:300]
    return body


@pytest.fixture(scope="module")
def aligned_server(tmp_path_factory):
    """Flags the shared servers lack: the tiny forced aligner (the timestamped routes' alignment), an --aliases file
    (a voice alias of our own, an OpenAI voice remapped, a model alias), --api-key and --segment-chars (a narration
    of a short text): one start for all."""
    aliases = tmp_path_factory.mktemp("aliases") / "aliases.yaml"
    aliases.write_text("voices:\n  narrator: Aiden\n  alloy: sohee\nmodels:\n  house-model: qwen3-tts\n")
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--forced-aligner", str(ALIGNER), "--aliases", str(aliases), "--api-key", API_KEY,
                           "--segment-chars", "40")
    yield server
    server.stop()


@pytest.mark.parametrize("output_format,response_format", [("pcm_24000", "pcm"), ("ulaw_8000", "ulaw")])
def test_convert_equals_the_speech_route(cv_server, output_format, response_format):
    """An ElevenLabs voice id (Rachel's) is the speaker the alias table gives it; greedy audio is /v1/audio/speech's
    to the byte; its model names and the SDK's unset model are the served model."""
    audio = b"".join(client(cv_server).text_to_speech.convert(
        "21m00Tcm4TlvDq8ikWAM", text=TEXT, model_id="eleven_multilingual_v2", output_format=output_format,
        request_options=OPTIONS))
    assert audio == speech(cv_server, "serena", response_format)


def test_stream_is_a_raw_audio_stream_equal_to_the_speech_routes(cv_server):
    """/stream: Content-Type audio/* (LiveKit checks it), audio equal to a streamed /v1/audio/speech; a speed it
    cannot apply while streaming and the fields Qwen3-TTS has no use for are named in a header."""
    body = {"text": TEXT, "voice_settings": {"stability": 0.5, "speed": 1.1}, "previous_text": "Hi."} | GREEDY
    status, headers, audio = request(cv_server.url + "/v1/text-to-speech/vivian/stream?output_format=pcm_16000",
                                     body, headers={"Content-Type": "application/json", "xi-api-key": "x"})
    assert status == 200 and headers["Content-Type"] == "audio/pcm"
    ignored = headers["x-omni-tts-ignored-fields"]
    assert all(name in ignored for name in ("voice_settings.stability", "voice_settings.speed", "previous_text"))
    assert audio == speech(cv_server, "vivian", "pcm", sample_rate=16000, stream_format="audio")
    sdk_audio = b"".join(client(cv_server).text_to_speech.stream("vivian", text=TEXT, output_format="pcm_16000",
                                                                 request_options=OPTIONS))
    assert sdk_audio == audio


def test_whole_response_takes_the_speed_seed_and_language(cv_server):
    """Sampled (not greedy): the seed is what makes the two equal."""
    body = {"text": TEXT, "voice_settings": {"speed": 1.2}, "seed": 5, "language_code": "en", "max_new_tokens": 24}
    status, headers, audio = request(cv_server.url + "/v1/text-to-speech/ryan?output_format=wav_24000", body)
    assert status == 200 and headers["Content-Type"] == "audio/wav"
    assert audio == speech(cv_server, "ryan", "wav", sampling={"max_new_tokens": 24}, speed=1.2, seed=5,
                           language="english")


def test_without_an_aligner_the_alignment_is_null(cv_server):
    answer = client(cv_server).text_to_speech.convert_with_timestamps("vivian", text=TEXT,
                                                                      output_format="pcm_24000",
                                                                      request_options=OPTIONS)
    assert_same_audio(base64.b64decode(answer.audio_base_64), speech(cv_server, "vivian", "pcm"))
    assert answer.alignment is None and answer.normalized_alignment is None


def check_alignment(alignment, text: str, seconds: float) -> None:
    """The characters spell `text`; times monotonic, each character's end after its start, within the audio."""
    assert "".join(alignment["characters"]) == text
    starts, ends = alignment["character_start_times_seconds"], alignment["character_end_times_seconds"]
    assert len(starts) == len(ends) == len(text)
    assert starts == sorted(starts) and ends == sorted(ends)
    assert all(0 <= s <= e <= seconds + 1e-3 for s, e in zip(starts, ends))


def test_timestamps_whole_and_streamed(aligned_server):
    """/with-timestamps: the whole audio (equal to convert's) and its characters; /stream/with-timestamps: lines of
    audio (together equal to it) and lines of characters, times absolute from the start."""
    tts = client(aligned_server).text_to_speech
    pcm = b"".join(tts.convert("vivian", text=TEXT, output_format="pcm_24000", request_options=OPTIONS))
    seconds = len(pcm) / 2 / 24000
    whole = tts.convert_with_timestamps("vivian", text=TEXT, output_format="pcm_24000", request_options=OPTIONS)
    assert_same_audio(base64.b64decode(whole.audio_base_64), pcm)
    check_alignment(whole.alignment.dict(), TEXT, seconds)
    assert whole.normalized_alignment == whole.alignment
    lines = list(tts.stream_with_timestamps("vivian", text=TEXT, output_format="pcm_24000", request_options=OPTIONS))
    assert_same_audio(b"".join(base64.b64decode(line.audio_base_64) for line in lines), pcm)
    alignments = [line.alignment.dict() for line in lines if line.alignment is not None]
    assert len(alignments) >= 2   # a line per sentence as the aligner times it
    check_alignment({key: [v for a in alignments for v in a[key]] for key in alignments[0]}, TEXT, seconds)


def test_timestamps_of_a_narration(aligned_server):
    """A text over one segment is narrated, as on /v1/audio/speech (same audio, pauses included); each segment
    aligned as it ends, the characters still spelling the whole text."""
    tts = client(aligned_server).text_to_speech
    pcm = speech(aligned_server, "vivian", "pcm", text=NARRATED)
    seconds = len(pcm) / 2 / 24000
    whole = tts.convert_with_timestamps("vivian", text=NARRATED, output_format="pcm_24000", request_options=OPTIONS)
    assert_same_audio(base64.b64decode(whole.audio_base_64), pcm)
    check_alignment(whole.alignment.dict(), NARRATED, seconds)
    lines = list(tts.stream_with_timestamps("vivian", text=NARRATED, output_format="pcm_24000",
                                            request_options=OPTIONS))
    assert_same_audio(b"".join(base64.b64decode(line.audio_base_64) for line in lines), pcm)
    alignments = [line.alignment.dict() for line in lines if line.alignment is not None]
    check_alignment({key: [v for a in alignments for v in a[key]] for key in alignments[0]}, NARRATED, seconds)


def test_the_aliases_file_names_voices_and_models(aligned_server):
    """--aliases: a voice alias of our own, a default alias remapped (alloy → sohee), a model alias."""
    tts = client(aligned_server).text_to_speech
    for voice_id, speaker in (("Narrator", "aiden"), ("alloy", "sohee")):
        audio = b"".join(tts.convert(voice_id, text=TEXT, model_id="house-model", output_format="pcm_24000",
                                     request_options=OPTIONS))
        assert_same_audio(audio, speech(aligned_server, speaker, "pcm"))
    aliases = json.loads(request(aligned_server.url + "/v1/audio/voices", headers=KEY)[2])["voice_aliases"]
    assert aliases["narrator"] == "aiden" and aliases["alloy"] == "sohee" and aliases["rachel"] == "serena"


def test_the_key_and_its_errors_in_each_clients_shape(aligned_server):
    """xi-api-key is the key; /v1/models, a path of both APIs, refuses a wrong one in the shape of the client's."""
    assert client(aligned_server).models.list()[0].model_id == MODEL
    with pytest.raises(ApiError) as refused:
        client(aligned_server, api_key="wrong").models.list()
    assert refused.value.status_code == 401 and refused.value.body["detail"]["status"] == "invalid_api_key"
    status, _, body = request(aligned_server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_voices_and_models(cv_server):
    sdk = client(cv_server)
    speakers = ["aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu", "vivian"]
    voices = sdk.voices.get_all().voices
    assert [v.voice_id for v in voices] == speakers and {v.category for v in voices} == {"premade"}
    page = sdk.voices.search(page_size=3, search="an")
    assert [v.voice_id for v in page.voices] == ["dylan", "ono_anna", "ryan"] and page.has_more
    assert page.total_count == 4
    rest = sdk.voices.search(page_size=3, search="AN", next_page_token=page.next_page_token)
    assert [v.voice_id for v in rest.voices] == ["vivian"] and not rest.has_more and rest.next_page_token is None
    assert sdk.voices.get("vivian").name == "vivian"
    livekit_default = sdk.voices.get("hpp4J3VqNfWAUOO0d1Us")
    assert livekit_default.voice_id == "hpp4J3VqNfWAUOO0d1Us" and "vivian" in livekit_default.description
    models = sdk.models.list()
    assert models[0].model_id == MODEL and "eleven_multilingual_v2" in [m.model_id for m in models]
    assert models[0].can_do_text_to_speech and {"language_id": "en", "name": "English"} in [
        lang.dict() for lang in models[0].languages]
    openai_list = json.loads(request(cv_server.url + "/v1/models")[2])   # the same path, asked by another client
    assert openai_list["object"] == "list" and openai_list["data"][0]["id"] == MODEL


def test_instant_clone_speaks_and_is_deleted(base_server):
    sdk = client(base_server)
    with open(REF_WAV, "rb") as clip:
        added = sdk.voices.ivc.create(name="el clone", files=[clip], description="from the SDK",
                                      labels={"accent": "none"}, remove_background_noise=True)
    assert added.voice_id == "el_clone" and added.requires_verification is False
    try:
        assert sdk.voices.get("el_clone").category == "cloned"
        assert "el_clone" in [v.voice_id for v in sdk.voices.get_all().voices]
        audio = b"".join(sdk.text_to_speech.convert("el_clone", text=TEXT, output_format="pcm_24000",
                                                    request_options=OPTIONS))
        assert_same_audio(audio, speech(base_server, "el_clone", "pcm"))
    finally:
        assert sdk.voices.delete("el_clone").status == "ok"
    with pytest.raises(ApiError) as missing:
        sdk.voices.get("el_clone")
    assert missing.value.status_code == 404 and missing.value.body["detail"]["param"] == "voice_id"


def test_instant_clone_needs_a_base_model(cv_server):
    with open(REF_WAV, "rb") as clip, pytest.raises(ApiError) as refused:
        client(cv_server).voices.ivc.create(name="nope", files=[clip])
    assert refused.value.status_code == 400 and "Base (voice clone)" in refused.value.body["detail"]["message"]


BAD_INPUT = [  # (voice_id, convert's arguments, status, param, what the message says)
    ("nobody", {}, 400, "voice_id", "unknown voice 'nobody'; available: aiden, dylan"),
    ("vivian", {"output_format": "flac_44100"}, 400, "output_format", "unknown output_format 'flac_44100'"),
    ("vivian", {"output_format": "pcm_32000"}, 400, "output_format", "32000"),
    ("vivian", {"text": " "}, 400, "text", "text must not be empty"),
    ("vivian", {"model_id": "nope"}, 404, "model_id", "model 'nope' is not served here"),
]


@pytest.mark.parametrize("voice_id,fields,status,param,message", BAD_INPUT, ids=[b[4][:20] for b in BAD_INPUT])
def test_bad_input_in_elevenlabs_shape(cv_server, voice_id, fields, status, param, message):
    with pytest.raises(ApiError) as refused:
        b"".join(client(cv_server).text_to_speech.convert(voice_id, **({"text": TEXT} | fields)))
    detail = refused.value.body["detail"]
    assert refused.value.status_code == status and detail["param"] == param and message in detail["message"], detail


def test_a_body_too_large_is_a_413_before_it_is_read(cv_server):
    with socket.create_connection(("127.0.0.1", cv_server.port)) as sock:
        sock.sendall(b"POST /v1/text-to-speech/vivian HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40000000\r\n\r\n")
        answer = sock.makefile("rb")
        head = []   # the status line and headers, then the answer's body: the request's was never sent
        while (line := answer.readline()) not in (b"\r\n", b""):
            head.append(line)
        length = next(int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length"))
        body = answer.read(length)
    assert head[0].startswith(b"HTTP/1.1 413") and json.loads(body)["detail"]["status"] == "payload_too_large"
