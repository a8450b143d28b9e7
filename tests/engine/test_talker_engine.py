"""Talker engine: the torch-free scheduler's bookkeeping, and the static-shape step (what CUDA graphs replay) against
the dynamic one on CPU."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.engine.buckets import batch_buckets
from omni_tts.engine.talker_runner import slot_buckets
from omni_tts.engine.talker_scheduler import RowMove, TalkerScheduler
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "benchmarks"))
from bench_step_ops import CASES, step_ops  # noqa: E402

EOS = 2150


def fake_request(rid: str, prompt_len: int, max_tokens: int = 100) -> TalkerRequest:
    shape = SimpleNamespace(shape=(prompt_len, 8))
    return TalkerRequest(rid, shape, SimpleNamespace(shape=(3, 8)), None, max_tokens)


def tokens(num_rows: int, eos_rows: tuple[int, ...] = ()) -> np.ndarray:
    out = np.ones((num_rows, 17), dtype=np.int64)
    out[list(eos_rows), 16] = EOS
    return out


def test_scheduler_is_torch_free():
    code = "import sys, omni_tts.engine.talker_scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prefill_budget_admits_together_then_waits():
    s = TalkerScheduler(max_rows=4, num_buffer_rows=5, max_model_len=1000, max_prefill_tokens=100, max_text_tokens=10,
                        eos_token_id=EOS)
    for i, length in enumerate([30, 50, 40, 10]):
        s.add(fake_request(f"r{i}", length))
    first = s.schedule()
    assert [r.request_id for r in first.admitted] == ["r0", "r1"] and first.first_row == 0 and first.num_rows == 2
    assert first.num_slots == 51
    assert s.num_requests == 4   # the talker's load (chunk_schedule auto): running, parked and waiting alike
    s.postprocess(first, tokens(2))
    second = s.schedule()
    assert [r.request_id for r in second.admitted] == ["r2", "r3"] and second.first_row == 2
    assert second.num_slots == 52  # r1 is one token further now
    # a prompt larger than the whole budget is still admitted, alone, at the start of a step
    s.add(fake_request("big", 300))
    s.postprocess(second, tokens(4))
    assert s.schedule().admitted == []  # no free row


def test_finished_and_aborted_rows_are_filled_from_the_end():
    s = TalkerScheduler(max_rows=4, num_buffer_rows=5, max_model_len=1000, max_prefill_tokens=1000, max_text_tokens=10,
                        eos_token_id=EOS)
    for i in range(4):
        s.add(fake_request(f"r{i}", 10 + i, max_tokens=3 if i == 1 else 100))
    schedule = s.schedule()
    outputs, moves = s.postprocess(schedule, tokens(4, eos_rows=(0,)))
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [
        ("r0", True, "stop"), ("r1", False, None), ("r2", False, None), ("r3", False, None)]
    assert moves == [RowMove(src=3, dst=0, length=14)]
    assert [r.request_id for r in s.running] == ["r3", "r1", "r2"]
    outputs, moves = s.postprocess(s.schedule(), tokens(3))
    assert [o.finish_reason for o in outputs] == [None, "length", None]  # r1: 3 tokens = prefill + 2 steps
    assert moves == [RowMove(src=2, dst=1, length=14)]
    assert s.abort("r3") == [RowMove(src=1, dst=0, length=14)] and [r.request_id for r in s.running] == ["r2"]
    assert s.abort("nobody") is None
    s.add(fake_request("w", 10))
    assert s.abort("w") == [] and not s.waiting


def test_limits_are_checked_at_add():
    s = TalkerScheduler(max_rows=2, num_buffer_rows=3, max_model_len=100, max_prefill_tokens=100, max_text_tokens=2,
                        eos_token_id=EOS)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(fake_request("long", 100))
    request = fake_request("fits", 90, max_tokens=1000)
    s.add(request)
    assert request.max_tokens == 11  # 90 prompt slots + 10 fed tokens = 100; the 11th token is never fed


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert slot_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert slot_buckets(1000) == [256, 512, 1000]


def run(tts, engine, requests, stagger, abort=None):
    """Requests join every `stagger` steps; abort = (step, request index). Returns {index: frames}."""
    prepared = [prepare(tts, r) for r in requests]
    frames = {i: [] for i in range(len(requests))}
    step = 0
    while step == 0 or engine.has_work() or step <= stagger * len(requests):
        for i, p in enumerate(prepared):
            if i * stagger == step:
                engine.add_request(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens))
        if abort and abort[0] == step:
            engine.abort(str(abort[1]))
        for out in engine.step():
            if out.frame is not None:
                frames[int(out.request_id)].append(out.frame)
        step += 1
    return {i: np.array(f) for i, f in frames.items()}


@pytest.mark.parametrize("temperature,top_k_off", [(0.0, ()), (0.9, ()), (0.9, (1, 2, 4))])
def test_static_shape_step_equals_dynamic_step(temperature, top_k_off):
    """Bucketed rows (padding rows in free slots) and bucketed attention slots give the dynamic path's codes,
    greedy and seeded sampling alike, with requests joining, finishing and being aborted mid-run. Requests
    `top_k_off` sample over the sorted vocabulary (request 2 in its code predictor only): while one runs, the
    static step takes every sampling path, otherwise the candidates only."""
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    voices = ["ryan", "vivian", "serena", "aiden", "sohee", "eric", "dylan"]
    off = {1: dict(temperature=0.9, top_k=0), 2: dict(subtalker_temperature=0.8, subtalker_top_k=0),
           4: dict(temperature=0.9, top_k=0, subtalker_top_k=100)}
    requests = [SynthesisRequest(text=f"Sentence {i}: the quick brown fox jumps.", voice=v, sampling=SamplingParams(
        **{"temperature": temperature, "seed": 100 + i, "max_new_tokens": 12 + 5 * i,
           **(off[i] if i in top_k_off else {})})) for i, v in enumerate(voices)]
    results = []
    for static in (False, True):
        # a fixed clock keeps every row's playback deadline ahead: no admission waits, in both runs alike, so the
        # abort finds request 3 as many frames in
        engine = TalkerEngine(tts.talker, tts.config, 8, 300, 512, 64, static_shapes=static, clock=lambda: 0.0)
        results.append(run(tts, engine, requests, stagger=2, abort=(9, 3)))
        assert engine.stats().num_running == 0
    dynamic, static = results
    for i in dynamic:
        assert len(dynamic[i]) > 0
        np.testing.assert_array_equal(static[i], dynamic[i])


def test_a_step_whose_rows_keep_a_small_top_k_skips_the_sorted_vocabulary():
    """The static step (what a graph replays) picks its sampling path set from the rows: with every row at the
    default top-k it runs fewer ops than with the sorted vocabulary's path, and greedy rows run the same step."""
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    counts = {name: step_ops(tts, 8, sampling).totals() for name, sampling in CASES.items()}
    assert counts["top-k 50"] == counts["greedy"]
    assert counts["top-k 50"][1] < counts["top-k off"][1]
