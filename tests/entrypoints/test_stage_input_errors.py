"""Input errors only the talker stage can find, over real sockets on the tiny Base checkpoint: an ICL prompt too long
once the clip's frames are known, a clip the speaker encoder refuses, a bad speaker embedding. Each is a 400 naming
the field (never a 500), counted as bad input, and never retried by a narration: whole, it answers 400; streamed, a
failure after its first audio is an error event of the same shape."""
import base64
import io
import json
import urllib.request

import msgspec
import numpy as np
import pytest
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from conftest import FIXTURES
from omni_tts.config import load_stage_config
from omni_tts.models.qwen3_tts.audio import load_audio_24k
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.orchestrator.input_processor import load_prompts
from omni_tts.orchestrator.narration import plan_segments
from server_util import ServerProcess, request

TINY_BASE = FIXTURES / "tiny-base"
CONFIG = Qwen3TTSConfig.load(str(TINY_BASE))
REF_TEXT = (FIXTURES / "ref_voice.txt").read_text().strip()
CLIP = load_audio_24k(str(FIXTURES / "ref_voice.wav")).astype(np.float32)   # 3.4 s
SAMPLES_PER_FRAME = 1920    # 24 kHz / 12.5 Hz codec frames
SEGMENT_CHARS = 102   # TEXT is longer: narrated; its second sentence is not: one segment
# a narration of two segments: the first sentence alone, then a longer one
TEXT = ("Hi. A longer sentence follows the greeting, with more words in it than the first segment has, to the "
        "end.")
GREEDY = {"model": "m", "language": "english", "temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def stage_config(tmp_path_factory) -> str:
    """cpu_tiny with a short max_model_len, so a clip of a few seconds can fill an ICL prompt."""
    data = msgspec.to_builtins(load_stage_config("cpu_tiny"))
    data["stages"]["talker"] |= {"max_model_len": 256, "max_text_tokens": 128, "kv_cache_tokens": 256 * 32}
    path = tmp_path_factory.mktemp("stage_config") / "short.yaml"
    path.write_bytes(msgspec.yaml.encode(data))
    return str(path)


@pytest.fixture(scope="module")
def server(stage_config, tmp_path_factory):
    server = ServerProcess("--model", str(TINY_BASE), "--stage-config", stage_config, "--served-model-name", "m",
                           "--forced-aligner", "none", "--segment-chars", str(SEGMENT_CHARS),
                           "--voices-dir", str(tmp_path_factory.mktemp("voices")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def long_clip(stage_config) -> str:
    """A clip whose frames fill the narration's first segment's ICL prompt up to a few rows, so the second, longer
    segment (and TEXT's second sentence alone) no longer fits: found only once the talker has the clip's codes."""
    prompts = load_prompts(str(TINY_BASE), CONFIG, load_stage_config(stage_config))
    first, second = (prompts.tokenize(SynthesisRequest(segment.text, language="english", ref_audio=CLIP,
                                                       ref_text=REF_TEXT))
                     for segment in plan_segments(prompts, TEXT, SEGMENT_CHARS))

    def fits(prompt, frames: int) -> bool:
        try:
            prompts.limits.check_fits(prompt, frames)
            return True
        except RequestError:
            return False
    frames = max(f for f in range(1, 376) if fits(first, f)) - 3   # a few frames of room to generate
    assert fits(second, 0) and not fits(second, frames)   # the API's check passes; the stage's will not
    return wav_uri(np.resize(CLIP, frames * SAMPLES_PER_FRAME), "PCM_16")


def wav_uri(samples: np.ndarray, subtype: str) -> str:
    data = io.BytesIO()
    sf.write(data, samples, 24000, format="WAV", subtype=subtype)
    return "data:audio/wav;base64," + base64.b64encode(data.getvalue()).decode()


# finite samples far outside [-1, 1]: the mel spectrogram overflows and the x-vector is NaN (the talker spoke noise)
LOUD_CLIP = wav_uri(CLIP * np.float32(1e20), "FLOAT")
BAD_EMBEDDING = [1e4] * CONFIG.speaker_encoder.enc_dim   # beyond MAX_EMBEDDING_ABS


def speak(server, **fields) -> tuple[int, dict, bytes]:
    return request(server.url + "/v1/audio/speech", dict(GREEDY, **fields))


def assert_400(answer: tuple[int, dict, bytes], param: str, says: str) -> None:
    status, _, body = answer
    assert status == 400, (status, body[:300])
    assert_bad_input(json.loads(body)["error"], param, says)


def assert_bad_input(error: dict, param: str, says: str) -> None:
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_request"), error
    assert says in error["message"] and "\n" not in error["message"], error


def counters(server) -> dict[tuple[str, str], float]:
    """(family, label value) → value of the counters these tests read."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "omni_tts_request_errors_total":
                values["errors", sample.labels["kind"]] = sample.value
            elif sample.name == "omni_tts_narration_segments_total":
                values["segments", sample.labels["event"]] = sample.value
    return values


class Counted:
    """What the counters moved by while the block ran."""

    def __init__(self, server) -> None:
        self.server = server

    def __enter__(self) -> "Counted":
        self.before = counters(self.server)
        return self

    def __exit__(self, *exc) -> None:
        after = counters(self.server)
        self.moved = {key: after[key] - self.before.get(key, 0) for key in after if after[key] != self.before.get(key)}


def test_an_icl_prompt_too_long_once_the_clip_is_known(server, long_clip):
    clone = {"ref_audio": long_clip, "ref_text": REF_TEXT}
    with Counted(server) as single:
        assert_400(speak(server, input=TEXT.split(". ", 1)[1], **clone), "ref_audio", "leaves no room to generate")
    assert single.moved == {("errors", "bad_input"): 1}
    with Counted(server) as whole:   # the first segment speaks, the second fails in the talker: the file is a 400
        assert_400(speak(server, input=TEXT, **clone), "ref_audio", "leaves no room to generate")
    assert whole.moved == {("errors", "bad_input"): 1, ("segments", "started"): 2, ("segments", "delivered"): 1}
    with Counted(server) as streamed:
        status, _, body = speak(server, input=TEXT, stream=True, stream_format="sse", response_format="pcm", **clone)
        events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
    assert status == 200 and [e["type"] for e in events if e["type"].startswith("speech.segment")] == [
        "speech.segment", "speech.segment.done"]
    assert events[-1]["type"] == "speech.audio.error"
    assert_bad_input(events[-1]["error"], "ref_audio", "leaves no room to generate")
    assert streamed.moved == {("errors", "bad_input"): 1, ("segments", "started"): 2, ("segments", "delivered"): 1}


def test_a_clip_the_speaker_encoder_refuses(server):
    says = "ref_audio gives no usable speaker embedding"
    with Counted(server) as single:
        assert_400(speak(server, input="Hello there.", ref_audio=LOUD_CLIP, x_vector_only_mode=True), "ref_audio",
                   says)
    assert single.moved == {("errors", "bad_input"): 1}
    with Counted(server) as narrated:   # its first segment fails: nothing was sent, and nothing is tried again
        assert_400(speak(server, input=TEXT, ref_audio=LOUD_CLIP, x_vector_only_mode=True), "ref_audio", says)
    assert narrated.moved[("errors", "bad_input")] == 1 and ("segments", "retried") not in narrated.moved
    # a clip voice's x-vector (EmbedVoice) is refused the same way
    boundary = "clipboundary"
    clip = base64.b64decode(LOUD_CLIP.split(",", 1)[1])
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nloud\r\n--{boundary}\r\n'
            'Content-Disposition: form-data; name="audio_sample"; filename="loud.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n").encode() + clip + f"\r\n--{boundary}--\r\n".encode()
    status, _, body = request(server.url + "/v1/audio/voices", data=form,
                              headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, body[:300]
    assert_400(request(server.url + "/v1/audio/voices/loud/embedding"), "name", f"voice 'loud': {says}")


def test_a_bad_speaker_embedding(server):
    with Counted(server) as counted:
        assert_400(speak(server, input="Hello there.", speaker_embedding=BAD_EMBEDDING), "speaker_embedding",
                   "must lie within")
        assert_400(speak(server, input=TEXT, speaker_embedding=BAD_EMBEDDING), "speaker_embedding", "must lie within")
    assert counted.moved == {("errors", "bad_input"): 2}


def test_no_input_error_was_retried_or_internal(server):
    """Run last: over the module, narration never tried a failed segment again, and no error counted as ours."""
    values = counters(server)
    assert values.get(("segments", "retried"), 0) == 0 and values.get(("errors", "internal"), 0) == 0
    assert values[("errors", "bad_input")] >= 7
