"""A chunk schedule set in a stage config (connector.chunk_schedule), served: a stream's chunks (one SSE audio delta
each) follow the profile, and its audio is the default config's, whose chunks double (the streaming decoder is exact
for any split of the frames)."""
import base64
import itertools
import json

import numpy as np
import pytest
import yaml

from conftest import FIXTURES
from server_util import MODEL, ServerProcess, request
from omni_tts.config.chunk_schedule import CHUNK_PROFILES
from omni_tts.config.stage_config import STAGE_CONFIG_DIR

SAMPLES_PER_FRAME = 1920   # 80 ms at 24 kHz
SPEECH = dict(model=MODEL, input="A sentence long enough for a few chunks of audio, and then some more words.",
              voice="ryan", response_format="pcm", stream=True, temperature=0.8, seed=7, max_new_tokens=90)


@pytest.fixture(scope="module")
def load_server(tmp_path_factory):
    """cpu_tiny with `chunk_schedule: load` in place of its doubling from 2 frames up to 25."""
    config = yaml.safe_load((STAGE_CONFIG_DIR / "cpu_tiny.yaml").read_text())
    del config["connector"]["initial_codec_chunk_frames"], config["connector"]["codec_chunk_frames"]
    config["connector"]["chunk_schedule"] = "load"
    path = tmp_path_factory.mktemp("config") / "stages.yaml"
    path.write_text(yaml.safe_dump(config))
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--stage-config", str(path))
    yield server
    server.stop()


def streamed(server) -> tuple[list[int], np.ndarray, int]:
    """One SSE stream of SPEECH: each audio delta's frames, the whole audio and the usage's frame count."""
    status, _, body = request(server.url + "/v1/audio/speech", SPEECH)
    assert status == 200, body
    events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
    assert events[-1]["type"] == "speech.audio.done"
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert all(len(d) % (2 * SAMPLES_PER_FRAME) == 0 for d in deltas)   # int16 samples, whole frames
    audio = np.frombuffer(b"".join(deltas), np.int16)
    return [len(d) // (2 * SAMPLES_PER_FRAME) for d in deltas], audio, events[-1]["usage"]["output_tokens"]


def cut(schedule: tuple[int, ...], num_frames: int) -> list[int]:
    """The chunks a schedule cuts `num_frames` frames into (the last one short)."""
    sizes = []
    for size in itertools.chain(schedule, itertools.repeat(schedule[-1])):
        if sum(sizes) >= num_frames:
            return sizes
        sizes.append(min(size, num_frames - sum(sizes)))


def test_a_profile_from_the_stage_config_cuts_the_chunks_and_keeps_the_audio(load_server, cv_server):
    sizes, audio, num_frames = streamed(load_server)
    default_sizes, default_audio, default_frames = streamed(cv_server)
    assert num_frames == default_frames and num_frames > sum(CHUNK_PROFILES["load"])   # past the ramp
    assert sizes == cut(CHUNK_PROFILES["load"], num_frames)                            # 4, 4, 8, 16, 25, ...
    assert default_sizes == cut((2, 4, 8, 16, 25), num_frames) != sizes                # cpu_tiny's doubling
    # the float audio of two splits differs by < 1e-5, which may move a sample across one int16 rounding step
    assert audio.shape == default_audio.shape
    np.testing.assert_allclose(audio, default_audio, atol=1, rtol=0)
