import json
import os
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.numpy import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tts"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
GOLDEN_CASES = [c for c in MANIFEST["cases"] if c.get("params")]
# greedy on tiny-custom-voice this text never meets EOS: it runs to the model's length limit (191 frames, ~2 s of
# serving on 2 cores), for tests that need a request still running
RUNS_TO_ITS_LIMIT = "The quick brown fox jumps over the lazy dog."

torch.set_grad_enabled(False)
# the fused kernels (Triton) run in Triton's interpreter on a machine without CUDA: set before anything imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tiny models' many small ops gain nothing from a second thread, and waiting threads spin: with stage processes
# or a neighbour on the same cores (or two hyperthreads of one core) that is minutes. Measured on 2 cores: 1 thread
# runs test_engines + test_code2wav_runner in 14 s against 17 s with 2, on half the CPU time.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow real-size checks")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# One server per checkpoint for the whole run, for every test that needs no flags of its own: a start costs seconds
# (a process, two stage processes, a model load), and a test that needs a fresh or differently configured server
# starts its own. Tests on these servers leave them as they found them, or make their changes under names of their own.
@pytest.fixture(scope="session")
def cv_server():
    """`omni-tts serve` of tiny-custom-voice, served as server_util.MODEL."""
    from server_util import MODEL, ServerProcess

    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def base_server(tmp_path_factory):
    """`omni-tts serve` of tiny-base with a voices dir (`.voices_dir`) and the fixtures as allowed local media."""
    from server_util import MODEL, ServerProcess

    voices_dir = tmp_path_factory.mktemp("voices")
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL, "--voices-dir",
                           str(voices_dir), "--allowed-local-media-path", str(FIXTURES))
    server.voices_dir = voices_dir
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def in_process_app():
    """The app `omni-tts serve` runs, in this process on the session's event loop (tiny-custom-voice served as "m",
    real stage processes): (url, ServerState), for the tests that look at the server's state between its steps (they
    run on that loop: `@pytest.mark.asyncio(loop_scope="session")`). Streams idle for 60 s; narrations 2 segments
    ahead."""
    from server_util import app_in_process
    from waiting import SHARED_PIPELINE

    async with app_in_process(str(FIXTURES / "tiny-custom-voice"), SHARED_PIPELINE, stream_idle_timeout=60,
                              narration_window=2) as served:
        yield served


def load_component(module_factory, checkpoint_dir, prefix: str):
    """Build a model component on the meta device and load its `prefix*` tensors strictly, in fp32 on the CPU."""
    from omni_tts.models.qwen3_tts.weights import load_strict, read_tensors, safetensors_files

    with torch.device("meta"):
        module = module_factory()
    return load_strict(module, read_tensors(safetensors_files(str(checkpoint_dir)), prefix), str(checkpoint_dir),
                       "cpu", torch.float32)


def case_arrays(case: dict) -> dict[str, np.ndarray]:
    return load_file(str(FIXTURES / case["file"]))


def case_rows(case: dict) -> list[dict]:
    """The reference call's parameters, one dict per batch row (list-valued params are per row)."""
    params = case["params"]
    n = len(params["text"]) if isinstance(params["text"], list) else 1
    return [{k: (v[i] if isinstance(v, list) else v) for k, v in params.items()} for i in range(n)]


def case_requests(case: dict):
    """SynthesisRequests equal to the reference call, greedy."""
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.sampling import SamplingParams

    requests = []
    for row in case_rows(case):
        ref_audio = str(FIXTURES / row["ref_audio"]) if row.get("ref_audio") else None
        requests.append(SynthesisRequest(
            text=row["text"], voice=row.get("speaker"), language=row.get("language"),
            instructions=row.get("instruct"), ref_audio=ref_audio, ref_text=row.get("ref_text"),
            x_vector_only=bool(row.get("x_vector_only_mode", False)), non_streaming_mode=row.get("non_streaming_mode"),
            sampling=SamplingParams(temperature=0, max_new_tokens=row["max_new_tokens"])))
    return requests


def stage_config(kind: str, measured_frame_budget: bool = False):
    """cpu_tiny with the connector of `kind` (shm, tcp, local), through the loader as a YAML's connector.kind goes;
    measured_frame_budget: code2wav measures its frame budget at start, as with a config that sets none."""
    import msgspec

    from omni_tts.config import load_stage_config, stage_config_from_dict

    data = msgspec.to_builtins(load_stage_config("cpu_tiny"))
    data["connector"]["kind"] = kind
    if measured_frame_budget:
        data["stages"]["code2wav"]["frame_budget"] = None
    return stage_config_from_dict(data, f"cpu_tiny with connector.kind {kind}")
