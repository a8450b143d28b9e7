"""LoRA rows in the talker engine (fp32, CPU, the tiny fixtures): greedy codes of rows on an adapter equal those of a
model with that adapter merged into its weights; a batch mixing two adapters and the base model is exact per row;
loading an adapter between two steps leaves running rows' codes as they were; the static-shape step (what CUDA
graphs replay) gives the dynamic step's codes."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FIXTURES
from lora_util import write_merged
from omni_tts.engine.offline import prepare, synthesize
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.engine.talker_runner import TalkerRunner
from omni_tts.models.qwen3_tts.lora import read_adapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_adapter
from omni_tts.models.qwen3_tts.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "benchmarks"))
from bench_step_ops import OpCounter  # noqa: E402

BASE = FIXTURES / "tiny-custom-voice"
TEXTS = ["Hello there, how are you today?", "A second sentence, somewhat longer than the first one.",
         "Short one."]
VOICES = ["ryan", "vivian", "serena"]


def greedy(i: int, max_new_tokens: int = 40) -> SynthesisRequest:
    return SynthesisRequest(text=TEXTS[i % 3], voice=VOICES[i % 3],
                            sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base model, [adapter 1, adapter 2], [model merged with adapter 1, with adapter 2])."""
    tmp = tmp_path_factory.mktemp("lora")
    tts = Qwen3TTS.from_pretrained(str(BASE))
    adapters = [read_adapter(make_random_adapter(str(tmp / f"a{seed}"), str(BASE), seed=seed), tts.config.talker, 16)
                for seed in (1, 2)]
    merged = [Qwen3TTS.from_pretrained(write_merged(BASE, a, tmp / f"merged{i}")) for i, a in enumerate(adapters)]
    return tts, adapters, merged


def codes(results) -> list[np.ndarray]:
    return [r.codes for r in results]


def test_adapter_rows_equal_the_merged_model_and_a_mixed_batch_is_exact_per_row(models):
    """Rows on adapter 1, adapter 2 and none in one batch: each row's greedy codes equal those of the model with
    its adapter merged (the base model's for none), and its own run alone; each adapter changes the codes."""
    tts, adapters, merged = models
    requests = [greedy(i) for i in range(6)]
    loras = [adapters[0], adapters[1], None, adapters[1], None, adapters[0]]
    batch = codes(synthesize(tts, requests, loras=loras))
    base = codes(synthesize(tts, requests))
    on_merged = [codes(synthesize(m, requests)) for m in merged]
    for i, lora in enumerate(loras):
        expected = base[i] if lora is None else on_merged[adapters.index(lora)][i]
        np.testing.assert_array_equal(batch[i], expected)
        alone = codes(synthesize(tts, [requests[i]], loras=[lora]))[0]
        np.testing.assert_array_equal(batch[i], alone)
    for m in on_merged:  # an adapter that changed nothing would prove nothing
        assert all(not np.array_equal(m[i], base[i]) for i in range(3))


def run_engine(tts, engine, requests, loras, stagger=2, between=None):
    """Requests join every `stagger` steps; between(step) runs before each step. Returns {index: frames}."""
    prepared = [prepare(tts, r) for r in requests]
    frames = {i: [] for i in range(len(requests))}
    step = 0
    while step == 0 or engine.has_work() or step <= stagger * len(requests):
        if between is not None:
            between(step)
        for i, p in enumerate(prepared):
            if i * stagger == step:
                engine.add_request(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens,
                                                 lora=loras[i]))
        for out in engine.step():
            if out.frame is not None:
                frames[int(out.request_id)].append(out.frame)
        step += 1
    return {i: np.array(f) for i, f in frames.items()}


def test_static_shape_step_with_adapters_equals_the_dynamic_step(models):
    """Rows on different adapters join, finish (their holes filled from the last row: the row's adapter slot moves
    with it) and pad a bucket; the static step gives the dynamic step's codes, and the merged models'."""
    tts, adapters, merged = models
    requests = [greedy(i, 12 + 6 * i) for i in range(6)]
    loras = ["a", None, "b", "a", "b", None]
    results = []
    for static in (False, True):
        engine = TalkerEngine(tts.talker, tts.config, 8, 300, 512, 64, static_shapes=static, max_loras=2,
                              max_lora_rank=8)
        engine.load_lora("a", adapters[0])
        engine.load_lora("b", adapters[1])
        results.append(run_engine(tts, engine, requests, loras))
    dynamic, static = results
    for i, lora in enumerate(loras):
        np.testing.assert_array_equal(static[i], dynamic[i])
        model = tts if lora is None else merged["ab".index(lora)]
        np.testing.assert_array_equal(dynamic[i], codes(synthesize(model, [requests[i]]))[0])


def test_a_row_moved_into_a_hole_keeps_its_adapter(models):
    """A row on an adapter moves into the hole of a finished row without one and runs on alone: it keeps its
    adapter (the slot moves with the row, on the device and in the host's mirror the eager step reads)."""
    tts, adapters, merged = models
    requests = [greedy(2, 6), greedy(1, 30)]
    for static in (False, True):
        engine = TalkerEngine(tts.talker, tts.config, 2, 300, 512, 64, static_shapes=static, max_loras=1)
        engine.load_lora("a", adapters[0])
        result = run_engine(tts, engine, requests, [None, "a"], stagger=0)
        assert len(result[0]) < len(result[1])
        np.testing.assert_array_equal(result[1], codes(synthesize(merged[0], [requests[1]]))[0])


def test_loading_an_adapter_between_steps_leaves_running_rows_as_they_were(models):
    """Rows on adapter 1 and on none run; adapter 2 is loaded (and a request on it joins) mid-run: the running
    rows' codes are those of the run without the load, the new row's those of its merged model."""
    tts, adapters, merged = models
    requests = [greedy(0, 60), greedy(1, 60), greedy(2, 30)]

    def engine():
        e = TalkerEngine(tts.talker, tts.config, 4, 300, 512, 64, max_loras=2)
        e.load_lora("one", adapters[0])
        return e

    undisturbed = run_engine(tts, engine(), requests[:2], ["one", None])
    loading = engine()

    def load_at_step_5(step):
        if step == 5:
            assert loading.stats().num_running == 2
            loading.load_lora("two", adapters[1])

    # request 2 joins at step 2 * 3 = 6, after the load
    result = run_engine(tts, loading, requests, ["one", None, "two"], stagger=3, between=load_at_step_5)
    reference = run_engine(tts, engine(), requests[:2], ["one", None], stagger=3)
    for i in range(2):
        np.testing.assert_array_equal(result[i], reference[i])
        np.testing.assert_array_equal(result[i], undisturbed[i])
    np.testing.assert_array_equal(result[2], codes(synthesize(merged[1], [requests[2]]))[0])


def slot_addresses(engine: TalkerEngine) -> list[int]:
    """Where every tensor the LoRA rows' forward reads lives."""
    lora = engine.runner.lora
    tensors = [t for layers in lora.stack_layers for groups in layers for a, bs in groups.values() for t in (a, *bs)]
    return [t.data_ptr() for t in tensors + list(lora.masks.values()) + [engine.runner.adapter_slots]]


def test_adapter_names_slots_and_unloading(models):
    """Unknown adapters fail the request on `model`; names and slots are checked; an adapter that requests hold is
    not unloaded, and its slot serves another adapter once it is; loading and unloading move no buffer."""
    tts, adapters, _ = models
    engine = TalkerEngine(tts.talker, tts.config, 2, 300, 512, 64, max_loras=1, max_lora_rank=4)
    addresses = slot_addresses(engine)
    p = prepare(tts, greedy(2, 5))
    with pytest.raises(RequestError) as info:
        engine.add_request(TalkerRequest("x", p.prefill, p.trailing, p.sampling, p.max_tokens, lora="nope"))
    assert info.value.param == "model" and "no LoRA adapter named 'nope' is loaded" in str(info.value)
    engine.load_lora("one", adapters[0])
    with pytest.raises(ValueError, match="named 'one' is loaded already"):
        engine.load_lora("one", adapters[1])
    with pytest.raises(ValueError, match=r"max_loras \(1\) adapters are loaded"):
        engine.load_lora("two", adapters[1])
    engine.add_request(TalkerRequest("r", p.prefill, p.trailing, p.sampling, p.max_tokens, lora="one"))
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.unload_lora("one")   # waiting
    engine.step()
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.unload_lora("one")   # running
    while engine.has_work():
        engine.step()
    engine.unload_lora("one")
    with pytest.raises(ValueError, match="no LoRA adapter named 'one'"):
        engine.unload_lora("one")
    engine.load_lora("two", adapters[1])
    assert engine.loras == {"two": 1}
    assert slot_addresses(engine) == addresses   # loads copy into the buffers a captured graph reads
    small = TalkerEngine(tts.talker, tts.config, 2, 300, 512, 64, max_loras=1, max_lora_rank=2)
    with pytest.raises(ValueError, match="rank 4 exceeds max_lora_rank 2"):
        small.load_lora("one", adapters[0])
    plain = TalkerEngine(tts.talker, tts.config, 2, 300, 512, 64)
    assert plain.runner.lora is None
    with pytest.raises(ValueError, match="max_loras: 0"):
        plain.load_lora("one", adapters[0])


@pytest.mark.parametrize("static", [False, True])
def test_a_step_without_adapter_rows_is_the_plain_step(models, static):
    """A step runs the LoRA path only when one of its rows has an adapter, the eager step and the static one (what
    a graph replays: both kinds are captured): a server configured for adapters pays nothing while its rows run
    on the base model."""
    tts, adapters, _ = models
    p = prepare(tts, greedy(0))

    def step_ops(max_loras: int, lora_slot: int) -> int:
        runner = TalkerRunner(tts.talker, tts.config, 2, 300, 64, static_shapes=static, max_loras=max_loras)
        if max_loras:
            runner.lora.load(1, adapters[0])
        runner.prefill([TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens, lora_slot=lora_slot)
                        for i in range(2)], 0)
        runner.decode(2, 200)
        with torch.inference_mode(), OpCounter() as counter:
            runner.decode(2, 200)
        return counter.totals()[1]

    assert step_ops(1, 0) == step_ops(0, 0) < step_ops(1, 1)


def test_cli_synthesize_with_an_adapter(models, tmp_path, capsys):
    """`omni-tts synthesize --lora DIR` gives the merged model's codes; a bad adapter is a one-line error naming
    its file."""
    from omni_tts.entrypoints.cli.commands import main as cli_main

    tts, adapters, merged = models
    base = ["synthesize", "--model", str(BASE), "--text", TEXTS[0], "--voice", "ryan", "--temperature", "0",
            "--max-new-tokens", "20", "--out", str(tmp_path / "x.wav")]
    assert cli_main(base + ["--lora", adapters[0].path, "--codes-out", str(tmp_path / "codes.npy")]) == 0
    expected = synthesize(merged[0], [SynthesisRequest(text=TEXTS[0], voice="ryan", sampling=SamplingParams(
        temperature=0, max_new_tokens=20))])[0].codes
    np.testing.assert_array_equal(np.load(tmp_path / "codes.npy"), expected)
    assert cli_main(base + ["--lora", str(tmp_path / "none")]) == 2
    assert f"{tmp_path / 'none'}: no such adapter directory" in capsys.readouterr().err
