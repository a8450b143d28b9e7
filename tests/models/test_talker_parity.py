"""Talker + code predictor + prompt builder against the reference goldens (no audio front end involved)."""
import numpy as np
import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FIXTURES, GOLDEN_CASES, case_arrays, case_requests, load_component
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.engine.offline import generate_codes
from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import PromptBuilder, SynthesisRequest, embed_prompt
from omni_tts.models.qwen3_tts.sampling import resolve_sampling
from omni_tts.models.qwen3_tts.talker import Talker
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer

TEXT_ONLY_CASES = [c for c in GOLDEN_CASES if c["variant"] != "tiny-base"]
_loaded = {}


def talker_for(variant: str, folded: bool = False):
    """folded: the code predictor's embedding projections and the text projection folded into tables (what
    Qwen3TTS loads)."""
    if (variant, folded) not in _loaded:
        model_dir = str(FIXTURES / variant)
        cfg = Qwen3TTSConfig.load(model_dir)
        talker = load_component(lambda: Talker(cfg.talker), model_dir, "talker.")
        if folded:
            talker.code_predictor.fold_embedding_projections()
            assert talker.code_predictor.projected_embeddings is not None  # the tiny talker has the projection
            talker.fold_text_projection()
        _loaded[variant, folded] = cfg, talker, PromptBuilder(cfg, load_text_tokenizer(model_dir))
    return _loaded[variant, folded]


@pytest.mark.parametrize("folded", [False, True], ids=["projections", "tables"])
@pytest.mark.parametrize("case", TEXT_ONLY_CASES, ids=lambda c: c["name"])
def test_prompt_and_codes_match_reference(case, folded):
    cfg, talker, builder = talker_for(case["variant"], folded)
    arrays = case_arrays(case)
    requests = case_requests(case)
    prompts = [builder.tokenize(r) for r in requests]
    embedded = [embed_prompt(talker, cfg, p) for p in prompts]
    for i, (prompt, (prefill, trailing)) in enumerate(zip(prompts, embedded)):
        assert prompt.role_ids + prompt.text_ids == arrays[f"text_ids_{i}"][:-5].tolist()
        if f"instruct_ids_{i}" in arrays:
            assert prompt.instruct_ids == arrays[f"instruct_ids_{i}"].tolist()
        golden = arrays["inputs_embeds"][i][arrays["attention_mask"][i] == 1]
        assert prefill.shape == golden.shape
        np.testing.assert_allclose(prefill.numpy(), golden, atol=1e-4, rtol=0)
        np.testing.assert_allclose(trailing.numpy(), arrays["trailing_text_hidden"][i][:trailing.shape[0]],
                                   atol=1e-4, rtol=0)
    params = [resolve_sampling(r.sampling, {}) for r in requests]
    limits = [token_limit(s.max_new_tokens, len(p.text_ids)) for s, p in zip(params, prompts)]
    out = generate_codes(talker, cfg, [e[0] for e in embedded], [e[1] for e in embedded], params, limits)
    for i, generated in enumerate(out):
        np.testing.assert_array_equal(generated.codes.numpy(), arrays[f"codes_{i}"])
        ended_on_eos = case["ended_on_eos"][i]
        assert generated.finish_reason == ("stop" if ended_on_eos else "length")


def test_batched_rows_equal_single_requests():
    """A batch of different lengths and layouts gives each row exactly what it gives alone."""
    case = next(c for c in TEXT_ONLY_CASES if c["name"] == "cv_eos_batch2_streaming_layout")
    cfg, talker, builder = talker_for(case["variant"])
    requests = case_requests(case)
    prepared = []
    for r in requests:
        p = builder.tokenize(r)
        prefill, trailing = embed_prompt(talker, cfg, p)
        prepared.append((prefill, trailing, resolve_sampling(r.sampling, {}), token_limit(r.sampling.max_new_tokens, len(p.text_ids))))
    batched = generate_codes(talker, cfg, *[list(x) for x in zip(*prepared)])
    for i, (prefill, trailing, sampling, limit) in enumerate(prepared):
        alone = generate_codes(talker, cfg, [prefill], [trailing], [sampling], [limit])[0]
        np.testing.assert_array_equal(batched[i].codes.numpy(), alone.codes.numpy())


def test_seeded_sampling_is_independent_of_batch_composition():
    case = TEXT_ONLY_CASES[0]
    cfg, talker, builder = talker_for(case["variant"])
    from omni_tts.models.qwen3_tts.sampling import SamplingParams
    request = case_requests(case)[0]
    prompt = builder.tokenize(request)
    prefill, trailing = embed_prompt(talker, cfg, prompt)
    seeded = resolve_sampling(SamplingParams(temperature=0.9, top_k=50, seed=1234, max_new_tokens=20), {})
    other = resolve_sampling(SamplingParams(temperature=1.0, top_p=0.8, seed=99, max_new_tokens=20), {})
    alone = generate_codes(talker, cfg, [prefill], [trailing], [seeded], [20])[0].codes
    in_batch = generate_codes(talker, cfg, [prefill, prefill], [trailing, trailing], [other, seeded], [20, 20])[1].codes
    again = generate_codes(talker, cfg, [prefill], [trailing], [seeded], [20])[0].codes
    np.testing.assert_array_equal(alone.numpy(), in_batch.numpy())
    np.testing.assert_array_equal(alone.numpy(), again.numpy())
    greedy = generate_codes(talker, cfg, [prefill], [trailing], [resolve_sampling(SamplingParams(temperature=0, max_new_tokens=20), {})], [20])[0].codes
    assert not np.array_equal(alone.numpy(), greedy.numpy())


class _CountOps(TorchDispatchMode):
    """Counts the aten ops (kernels, on a GPU) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_prompts_text_costs_the_same_ops_however_long_it_is():
    """The talker embeds a prompt's text by one lookup in the folded table, not a projection per token: a 2,000-token
    admission costs the talker's loop what a short one does."""
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    counts = []
    for text in ("Hi.", "A somewhat longer sentence, read aloud. " * 250):
        prompt = tts.prompts.tokenize(SynthesisRequest(text=text, voice="ryan"))
        with _CountOps() as ops:
            embed_prompt(tts.talker, tts.config, prompt)
        counts.append((len(prompt.text_ids), ops.count))
    (short, short_ops), (long, long_ops) = counts
    assert short < 10 < 1000 < long and long_ops == short_ops, counts
