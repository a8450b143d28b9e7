"""The talker's static-shape prefill (what CUDA graphs replay) against the dynamic one on CPU, fp32: the same codes
for groups of 1..8 prompts of mixed lengths joining running rows, an eager fallback beyond the largest bucket, only
the admitted rows written, and the goldens exact."""
import numpy as np
import pytest
import torch

from conftest import FIXTURES, GOLDEN_CASES, case_arrays, case_requests
from omni_tts.engine.buckets import bucket
from omni_tts.engine.offline import generate_codes, prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.engine.talker_prefill import MAX_PREFILL_BATCH, StaticPrefill, prefill_groups, prefill_length_buckets
from omni_tts.engine.talker_runner import TalkerRunner
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams

_models: dict[str, Qwen3TTS] = {}


def model(variant: str = "tiny-custom-voice") -> Qwen3TTS:
    if variant not in _models:
        _models[variant] = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    return _models[variant]


def talker_request(tts: Qwen3TTS, rid: str, text: str, streaming: bool, temperature: float = 0.0,
                   max_new_tokens: int = 8, **fields) -> TalkerRequest:
    p = prepare(tts, SynthesisRequest(text=text, non_streaming_mode=not streaming, sampling=SamplingParams(
        temperature=temperature, seed=int(rid) + 7, max_new_tokens=max_new_tokens), **fields))
    return TalkerRequest(rid, p.prefill, p.trailing, p.sampling, p.max_tokens)


def test_the_short_prompts_that_occur_are_captured_at_their_exact_length():
    """The streaming layouts' prompts (CustomVoice with and without a language, VoiceDesign with and without short
    instructions, an x-vector voice) are each a bucket of their own: no padding; the fewest rows are the first."""
    buckets = prefill_length_buckets(1023)
    cv, vd, base = model(), model("tiny-voice-design"), model("tiny-base")
    vector = np.zeros(base.config.speaker_encoder.enc_dim, dtype=np.float32)
    prompts = [(cv, dict(voice="ryan")), (cv, dict(voice="ryan", language="English")),
               (vd, {}), (vd, dict(instructions="calm")), (base, dict(speaker_embedding=vector, language="English"))]
    lengths = {talker_request(tts, "0", "Hello there, friend.", streaming=True, **fields).prompt_len
               for tts, fields in prompts}
    assert min(lengths) == buckets[0] and all(bucket(buckets, n) == n for n in lengths), (lengths, buckets)


def test_groups_hold_at_most_eight_prompts_within_twice_their_length_and_the_capacity():
    buckets = prefill_length_buckets(200)
    groups, eager = prefill_groups([9, 10, 150, 12, 30, 250, 9, 9, 9, 9, 9, 9, 9, 20], buckets, 256)
    assert eager == [5]                                     # 250 > the largest bucket (200)
    assert groups == [(192, [2]), (32, [4, 13]), (12, [3, 1, 0, 6, 7, 8, 9, 10]), (9, [11, 12])]


def run(engine: TalkerEngine, admissions: list[list[TalkerRequest]], stagger: int) -> dict[str, np.ndarray]:
    """Admission i's requests join at step i * stagger, beside the rows still running."""
    frames: dict[str, list] = {r.request_id: [] for batch in admissions for r in batch}
    step = 0
    while step <= stagger * len(admissions) or engine.has_work():
        if step % stagger == 0 and step // stagger < len(admissions):
            for r in admissions[step // stagger]:
                engine.add_request(TalkerRequest(r.request_id, r.prefill, r.trailing, r.sampling, r.max_tokens))
        for out in engine.step():
            if out.frame is not None:
                frames[out.request_id].append(out.frame)
        step += 1
    return {k: np.array(v) for k, v in frames.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_static_prefill_equals_dynamic_prefill(temperature, monkeypatch):
    """Admissions of 1..8 prompts (short streaming prompts of 9-10 rows, whole texts of 21-43 rows, one beyond the
    largest bucket, prefilled eagerly) join rows that are running, at first rows > 0: the codes of every request
    equal the dynamic prefill's, greedy and seeded sampling alike."""
    tts = model()
    voices = ["ryan", "vivian", "serena", "aiden", "sohee", "eric", "dylan"]
    counter = iter(range(1000))

    def short(language: str | None = None) -> TalkerRequest:
        i = next(counter)
        return talker_request(tts, str(i), f"Line {i}, short.", True, temperature, voice=voices[i % 7],
                              language=language)

    def whole(words: int) -> TalkerRequest:
        i = next(counter)
        return talker_request(tts, str(i), " ".join(["word"] * words) + f" {i}.", False, temperature,
                              voice=voices[i % 7])

    admissions = [[whole(90)], [short() for _ in range(8)], [short("English"), short()],
                  [whole(20), short(), whole(8), short("English"), short()], [short() for _ in range(3)],
                  [whole(30), whole(12), short()], [short() for _ in range(7)], [short() for _ in range(6)],
                  [short("English") for _ in range(4)], [short(), short("English"), short(), short(), short()]]
    max_prefill_tokens = 96   # every admission is prefilled in the step it arrives
    assert max(r.prompt_len for r in admissions[0]) > max_prefill_tokens   # beyond the largest bucket
    shapes = []
    record = StaticPrefill.prefill
    monkeypatch.setattr(StaticPrefill, "prefill", lambda self, prompts, rows, length, lora: (
        shapes.append((len(prompts), length, min(rows))), record(self, prompts, rows, length, lora))[1])
    results = []
    for static in (False, True):
        engine = TalkerEngine(tts.talker, tts.config, 40, 160, max_prefill_tokens, 64, static_shapes=static)
        results.append(run(engine, admissions, stagger=2))
        assert engine.stats().num_running == 0
    dynamic, static = results
    assert {b for b, _, _ in shapes} == set(range(1, MAX_PREFILL_BATCH + 1))   # every group size ran
    assert min(first for _, _, first in shapes) > 0 and len({length for _, length, _ in shapes}) > 3
    for rid in dynamic:
        assert len(dynamic[rid]) > 0
        np.testing.assert_array_equal(static[rid], dynamic[rid], err_msg=f"request {rid}")


def test_static_prefill_writes_only_the_admitted_rows():
    """Groups of mixed lengths into rows 2..4 (two groups, one padded): every other row's cache, hidden state and
    logits are untouched (rows 0-1 running, the top row parked), and the admitted rows' prompt slots hold what the
    dynamic prefill writes."""
    tts = model()
    requests = [talker_request(tts, str(i), text, streaming, voice="ryan") for i, (text, streaming) in
                enumerate([("Hi.", True), (" ".join(["word"] * 30), False), ("Hey there.", True)])]
    torch.manual_seed(0)
    runners = {static: TalkerRunner(tts.talker, tts.config, 6, 100, 64, static_shapes=static) for static in (0, 1)}
    for runner in runners.values():
        for buffer in (runner.cache.k, runner.cache.v, runner.hidden):
            buffer.copy_(torch.randn_like(buffer))   # the same values in both runners (the same seed order)
        torch.manual_seed(0)
    runner = runners[1]
    before = [t.clone() for t in (runner.cache.k, runner.cache.v, runner.hidden, runner.logits)]
    groups, _ = prefill_groups([r.prompt_len for r in requests], runner.static_prefill.length_buckets,
                               runner.static_prefill.capacity)
    assert len(groups) == 2 and any(length > max(requests[i].prompt_len for i in members)
                                    for length, members in groups)   # a padded group
    for r in runners.values():
        r.prefill(requests, 2)
    admitted = [2, 3, 4]
    others = [row for row in range(runner.num_buffer_rows) if row not in admitted]
    for old, new in zip(before, (runner.cache.k, runner.cache.v, runner.hidden, runner.logits)):
        dim = 1 if new.dim() == 5 else 0
        assert torch.equal(old.index_select(dim, torch.tensor(others)), new.index_select(dim, torch.tensor(others)))
    for i, request in enumerate(requests):
        row, n = 2 + i, request.prompt_len
        for kind in ("k", "v"):
            got, want = (getattr(r.cache, kind)[:, row, :, :n] for r in (runner, runners[0]))
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(runner.hidden[2:5], runners[0].hidden[2:5], atol=1e-6, rtol=1e-5)
    assert torch.equal(runner.c0[2:5], runners[0].c0[2:5])


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda c: c["name"])
def test_goldens_hold_with_static_shapes(case):
    """Every golden case's codes, exact in fp32, through the static-shape prefill and step."""
    tts = model(case["variant"])
    prepared = [prepare(tts, r) for r in case_requests(case)]
    generated = generate_codes(tts.talker, tts.config, [p.prefill for p in prepared], [p.trailing for p in prepared],
                               [p.sampling for p in prepared], [p.max_tokens for p in prepared], static_shapes=True)
    arrays = case_arrays(case)
    for i, g in enumerate(generated):
        np.testing.assert_array_equal(g.codes.numpy(), arrays[f"codes_{i}"])
