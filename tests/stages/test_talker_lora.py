"""LoRA adapters in a real TalkerStage (its loop on a thread, real sockets and ring): a start-up adapter and one
loaded at run time (LoadLoRA, read beside the loop, while a stream runs) serve requests that name them, with the
codes offline synthesis gives; bad adapters, unknown names and unloads are answered with failures naming the
problem, and a bad start-up adapter fails the stage's start naming its file."""
import dataclasses
import json

import msgspec
import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.config import Code2WavStageConfig, PipelineConfig, StagesConfig, TalkerStageConfig
from omni_tts.connectors.shm_ring import RingOwner
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.lora import LoRAError, read_adapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_adapter
from omni_tts.models.qwen3_tts.sampling import SamplingParams, resolve_sampling
from omni_tts.stages.messages import (AddRequest, AppendText, FailureKind, LoadLoRA, LoRALoaded, LoRAUnloaded,
                                      StageLaunch, TalkerDone, UnloadLoRA)
from omni_tts.stages.talker_stage import TalkerStage
from stage_harness import StageHarness

BASE = FIXTURES / "tiny-custom-voice"
TALKER = TalkerStageConfig(device="cpu", max_model_len=512, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    return [make_random_adapter(str(tmp / f"a{seed}"), str(BASE), seed=seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def tts():
    return Qwen3TTS.from_pretrained(str(BASE))


def request(text: str, max_tokens: int) -> SynthesisRequest:
    return SynthesisRequest(text=text, voice="ryan", sampling=SamplingParams(temperature=0, max_new_tokens=max_tokens))


def add(tts, rid: str, synthesis: SynthesisRequest, lora: str | None) -> AddRequest:
    return AddRequest(request_id=rid, prompt=tts.prompts.tokenize(synthesis),
                      sampling=resolve_sampling(synthesis.sampling, tts.generation_config),
                      max_tokens=synthesis.sampling.max_new_tokens, return_codes=True, lora=lora)


def done_codes(done: TalkerDone) -> np.ndarray:
    assert done.failure is None, done.failure
    return np.frombuffer(done.codes, dtype=np.int32).reshape(-1, 16)


def test_adapters_loaded_at_start_and_at_run_time_serve_their_requests(tts, adapters, tmp_path):
    adapter = [read_adapter(path, tts.config.talker, 8) for path in adapters]
    stage = StageHarness(model_dir=BASE, talker=TALKER, loras={"one": adapters[0]})
    try:
        long, short = request("A sentence that keeps the stream going for a while.", 60), request("Hello.", 20)
        streaming = dataclasses.replace(short, non_streaming_mode=False)
        stage.send(add(tts, "long", long, "one"))
        stage.send(LoadLoRA("two", adapters[1]))   # read beside the loop while "long" runs
        assert stage.next_event(LoRALoaded) == LoRALoaded("two")
        stage.send(add(tts, "two", short, "two"))
        stage.send(add(tts, "base", short, None))
        done = {}
        while len(done) < 3:
            event = stage.next_event(TalkerDone)
            done[event.request_id] = done_codes(event)
        expected = synthesize(tts, [long, short, short], loras=[adapter[0], adapter[1], None])
        for rid, result in zip(("long", "two", "base"), expected):
            np.testing.assert_array_equal(done[rid], result.codes)

        # an unknown adapter fails the request on `model`; a bad one, its load, naming the file
        stage.send(add(tts, "nope", short, "nope"))
        failure = stage.next_event(TalkerDone).failure
        assert failure.kind is FailureKind.BAD_INPUT and failure.param == "model" and "'nope'" in failure.message
        config = json.loads(open(f"{adapters[0]}/adapter_config.json").read())
        bad = tmp_path / "rank16"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
        stage.send(LoadLoRA("bad", str(bad)))
        failure = stage.next_event(LoRALoaded).failure
        assert failure.kind is FailureKind.BAD_INPUT and failure.param == "lora_path"
        assert failure.message == f"{bad}/adapter_config.json: rank 16 exceeds the configured max_lora_rank 8"
        stage.send(LoadLoRA("one", adapters[1]))
        assert "named 'one' is loaded already" in stage.next_event(LoRALoaded).failure.message

        # an adapter a request holds is not unloaded; once the request is done, it is. The holder's text stays open
        # (all of it but its end is here: it waits in the engine for the end), so it holds the adapter until told
        holder = msgspec.structs.replace(add(tts, "holder", streaming, "one"), text_open=True)
        stage.send(holder)
        stage.send(UnloadLoRA("one"))
        failure = stage.next_event(LoRAUnloaded).failure
        assert failure.param == "lora_name" and "'one' is in use by 1 request(s)" in failure.message
        stage.send(AppendText("holder", [], holder.max_tokens, done=True))
        done_codes(stage.next_event(TalkerDone))
        stage.send(UnloadLoRA("one"))
        assert stage.next_event(LoRAUnloaded) == LoRAUnloaded("one")
        stage.send(UnloadLoRA("one"))
        failure = stage.next_event(LoRAUnloaded).failure
        assert failure.param == "lora_name" and "no LoRA adapter named 'one'" in failure.message
    finally:
        stage.close()


def test_a_bad_start_up_adapter_fails_the_start_naming_its_file(tmp_path):
    ring = RingOwner.create(4, 25)
    try:
        pipeline = PipelineConfig(stages=StagesConfig(talker=TALKER, code2wav=Code2WavStageConfig(device="cpu")))
        launch = StageLaunch(stage="talker", model_dir=str(BASE), pipeline=pipeline, max_batch_size=2, threads=1,
                             command_address="ipc://unused", event_address="ipc://unused", connector=ring.spec,
                             loras={"gone": str(tmp_path / "gone")})
        with pytest.raises(LoRAError, match=f"^{tmp_path / 'gone'}: no such adapter directory$"):
            TalkerStage(launch)
    finally:
        ring.close()
