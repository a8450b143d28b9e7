"""Talker requests whose text arrives while they run: parked rows, in the scheduler's bookkeeping and, in-process on
the CPU, codes identical to the whole-text requests on the dynamic and the static-shape (CUDA-graph) paths."""
import random
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.engine.buckets import bucket
from omni_tts.engine.talker_scheduler import RowMove, TalkerScheduler
from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest, embed_prompt, embed_text
from omni_tts.models.qwen3_tts.sampling import SamplingParams

EOS = 2150


def open_fake(rid: str, trailing: int, max_tokens: int = 100) -> TalkerRequest:
    return TalkerRequest(rid, SimpleNamespace(shape=(10, 8)), SimpleNamespace(shape=(trailing, 8)), None, max_tokens,
                         text_done=False)


def step(s: TalkerScheduler) -> tuple:
    schedule = s.schedule()
    tokens = np.ones((schedule.num_rows, 17), dtype=np.int64)
    outputs, moves = s.postprocess(schedule, tokens)
    return schedule, outputs, moves


def test_rows_park_at_the_top_and_come_back_below_the_running_ones():
    s = TalkerScheduler(max_rows=3, num_buffer_rows=4, max_model_len=1000, max_prefill_tokens=1000,
                        max_text_tokens=50, eos_token_id=EOS)
    s.add(open_fake("a", trailing=1))
    s.add(open_fake("b", trailing=0))    # its prefill runs; its first step needs a row that is not there
    s.add(TalkerRequest("c", SimpleNamespace(shape=(10, 8)), SimpleNamespace(shape=(4, 8)), None, 100))
    schedule, outputs, _ = step(s)
    assert [r.request_id for r in schedule.admitted] == ["a", "b", "c"]
    assert schedule.parked == [RowMove(1, 3, 10), RowMove(2, 1, 10)]   # b to the top, c into its hole
    assert schedule.num_rows == 2 and [o.request_id for o in outputs] == ["a", "c"]
    schedule, outputs, _ = step(s)                                      # a used its one row: parked below b
    assert schedule.parked == [RowMove(0, 2, 11), RowMove(1, 0, 11)]
    assert [r.request_id for r in s.running] == ["c"] and [r.request_id for r in s.parked] == ["b", "a"]
    assert s.stats().free_rows == 0 and s.stats().num_parked == 2
    s.add(open_fake("d", trailing=3))
    schedule, _, _ = step(s)
    assert schedule.admitted == []                                     # parked rows hold their rows
    assert s.append_text("b", 2, 100, False)[1:] == (3, 0)             # (row, start)
    schedule, outputs, _ = step(s)
    assert schedule.unparked == [RowMove(3, 1, 10), RowMove(2, 3, 11)]  # b back to row 1; a moves up to row 3
    assert [o.request_id for o in outputs] == ["c", "b"]
    assert s.abort("a") == [] and not s.parked
    assert s.append_text("gone", 1, 100, True) is None


def test_open_text_waits_at_its_limit_and_ends_once_the_text_is_whole():
    s = TalkerScheduler(max_rows=2, num_buffer_rows=3, max_model_len=1000, max_prefill_tokens=1000,
                        max_text_tokens=50, eos_token_id=EOS)
    s.add(open_fake("a", trailing=10, max_tokens=3))
    for _ in range(2):
        _, outputs, _ = step(s)
        assert not outputs[0].finished                                  # 3 tokens: the prefill's and two steps'
    schedule, outputs, _ = step(s)
    assert outputs == [] and [r.request_id for r in s.parked] == ["a"]  # waits: more text may raise the limit
    assert not s.has_work()
    s.append_text("a", 1, 3, True)
    assert s.has_work()
    _, outputs, _ = step(s)
    assert outputs[0].frame is None and outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_text_tokens"):
        s.add(open_fake("b", trailing=50))
        s.append_text("b", 2, 100, False)


VOICES = ["ryan", "vivian", "serena", "aiden", "eric", "dylan"]
TEXTS = ["Hello there, this sentence arrives a few words at a time.", "Short one.",
         "Numbers like 42 and 2026, then a pause, then more words to read.", "今天天气很好，我们去公园散步吧。",
         "A longer sentence that keeps going, with commas, clauses and a final word.", "Mixed 文本 text 42."]


def run(tts, engine, prepared, plans):
    """plans[i]: None (the whole text, joining at step i) or [(step, text tokens known), ...], the first entry
    being the join with the prefill's text. Returns {i: codes}."""
    frames = {i: [] for i in range(len(prepared))}
    events = sorted(((at, tokens, i) for i, plan in enumerate(plans) for at, tokens in (plan or [(i, None)])),
                    key=lambda event: (event[0], event[2]))
    known = {}
    step = 0
    while engine.has_work() or events:
        while events and events[0][0] <= step:
            _, tokens, i = events.pop(0)
            p, rid = prepared[i], str(i)
            ids, limit = p.prompt.text_ids, p.sampling.max_new_tokens
            if tokens is None:
                engine.add_request(TalkerRequest(rid, p.prefill, p.trailing, p.sampling, p.max_tokens))
                continue
            done = tokens >= len(ids)
            if i not in known:
                prompt = msgspec.structs.replace(p.prompt, text_ids=ids[:tokens])
                prefill, trailing = embed_prompt(tts.talker, tts.config, prompt, text_done=done)
                engine.add_request(TalkerRequest(rid, prefill, trailing, p.sampling, token_limit(limit, tokens),
                                                 text_done=done))
            else:
                rows = embed_text(tts.talker, tts.config, ids[known[i]:tokens], done)
                engine.append_text(rid, rows, token_limit(limit, tokens), done)
            known[i] = tokens
        for out in engine.step():
            if out.frame is not None:
                frames[int(out.request_id)].append(out.frame)
        step += 1
        assert step < 3000
    return {i: np.array(f) for i, f in frames.items()}


def checked_decode(engine: TalkerEngine, most_parked: list[int]):
    """The runner's decode, checking that the rows it computes (its bucket: padding rows included) are the running
    rows and reach no parked row."""
    decode, scheduler, runner = engine.runner.decode, engine.scheduler, engine.runner

    def run_decode(num_rows: int, num_slots: int):
        assert num_rows == len(scheduler.running)
        computed = bucket(runner.batch_buckets, num_rows) if runner.static_shapes else num_rows
        assert computed <= runner.num_buffer_rows - len(scheduler.parked)
        most_parked[0] = max(most_parked[0], len(scheduler.parked))
        return decode(num_rows, num_slots)
    return run_decode


def arrival_plan(rng: random.Random, num_tokens: int, first: int, join: int) -> list:
    """Text arrives in random pieces at random steps after `join` (with `first` tokens), a long pause included."""
    plan, known, at = [(join, min(first, num_tokens))], min(first, num_tokens), join
    pause = rng.randrange(max(1, num_tokens // 2))
    while known < num_tokens:
        at += rng.choice([0, 1, 1, 2, 3]) + (12 if known >= pause and pause >= 0 else 0)
        pause = -1 if known >= pause else pause
        known = min(num_tokens, known + rng.randint(1, 4))
        plan.append((at, known))
    return plan


@pytest.mark.parametrize("variant", ["tiny-custom-voice", "tiny-base"])
def test_text_arriving_late_gives_the_whole_texts_codes_dynamic_and_static(variant):
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    rng = random.Random(5)
    if variant == "tiny-custom-voice":
        requests = [SynthesisRequest(text=TEXTS[i % len(TEXTS)], voice=VOICES[i % len(VOICES)], non_streaming_mode=False,
                                     sampling=SamplingParams(temperature=0, max_new_tokens=16 + 4 * i))
                    for i in range(7)]
    else:  # ICL: the prefill holds as many text tokens as the reference has frames; x-vector only: one
        ref = dict(ref_audio=str(FIXTURES / "ref_voice.wav"), ref_text=(FIXTURES / "ref_voice.txt").read_text())
        long_text = " ".join(TEXTS[:5])
        requests = [SynthesisRequest(text=long_text if i % 2 else TEXTS[i], x_vector_only=i % 3 == 0,
                                     sampling=SamplingParams(temperature=0, max_new_tokens=60), **ref)
                    for i in range(4)]
    prepared = [prepare(tts, r) for r in requests]
    plans = []
    for i, p in enumerate(prepared):
        first = p.prompt.prefill_text_tokens
        plans.append(None if i % 3 == 2 else arrival_plan(rng, len(p.prompt.text_ids), first, join=i))
    assert assert_whole_texts_codes(tts, prepared, plans, max_rows=5) >= 2, "the arrivals must make rows wait"


def assert_whole_texts_codes(tts, prepared, plans, max_rows: int) -> int:
    """Run the plans on the dynamic and the static path; each request's codes must be its whole text's. Returns
    the most rows parked at once."""
    reference = run(tts, TalkerEngine(tts.talker, tts.config, 16, 160, 1024, 128), prepared, [None] * len(prepared))
    most_parked = [0]
    for static in (False, True):
        engine = TalkerEngine(tts.talker, tts.config, max_rows, 160, 1024, 128, static_shapes=static)
        engine.runner.decode = checked_decode(engine, most_parked)
        codes = run(tts, engine, prepared, plans)
        for i in reference:
            assert len(reference[i]) > 0
            np.testing.assert_array_equal(codes[i], reference[i], err_msg=f"request {i}, static={static}")
        assert engine.stats().request_ids == []
    return most_parked[0]


def test_parked_rows_lie_beyond_a_full_buckets_padding():
    """Five rows run (bucket 8: three padding rows) while three wait for text: the parked rows must be out of the
    padding's reach, or the throw-away values computed there would overwrite their state."""
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    requests = [SynthesisRequest(text=TEXTS[i % len(TEXTS)], voice=VOICES[i % len(VOICES)], non_streaming_mode=False,
                                 sampling=SamplingParams(temperature=0, max_new_tokens=24)) for i in range(8)]
    prepared = [prepare(tts, r) for r in requests]
    plans = [[(0, 2), (30, len(p.prompt.text_ids))] if i < 3 else None for i, p in enumerate(prepared)]
    assert assert_whole_texts_codes(tts, prepared, plans, max_rows=8) == 3
