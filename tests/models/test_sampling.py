"""Logits processing (reference order and semantics), parameter resolution and the token cap."""
import math

import pytest
import torch

from conftest import FIXTURES
from omni_tts.engine.offline import synthesize
from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import (ALL_PATHS, CANDIDATES, CANDIDATES_ONLY, GREEDY, SORTED_ONLY,
                                                BatchSampler, RowWarpers, SamplingParams, _sample_candidates,
                                                _sample_sorted, exponential_noise, hash_ids, noise_keys,
                                                resolve_sampling, warp_and_sample)
from omni_tts.models.qwen3_tts.sampling_params import SamplingDefaults, SamplingError

GEN = {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
       "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
       "max_new_tokens": 8192}


def test_resolution_order_and_greedy_propagation():
    r = resolve_sampling(SamplingParams(), GEN)
    assert (r.temperature, r.top_k, r.repetition_penalty, r.max_new_tokens, r.subtalker_temperature) == (0.9, 50, 1.05, 8192, 0.9)
    r = resolve_sampling(SamplingParams(), {})  # wrapper fallback
    assert r.max_new_tokens == 2048
    r = resolve_sampling(SamplingParams(temperature=0), GEN)
    assert r.temperature == 0 and r.subtalker_temperature == 0  # greedy talker => greedy code predictor
    r = resolve_sampling(SamplingParams(temperature=0, subtalker_temperature=0.7), GEN)
    assert r.subtalker_temperature == 0.7
    r = resolve_sampling(SamplingParams(), dict(GEN, do_sample=False, subtalker_dosample=False))
    assert r.temperature == 0 and r.subtalker_temperature == 0
    assert resolve_sampling(SamplingParams(seed=5), GEN).seed == 5


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", 101.0), ("temperature", math.nan),
                                         ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1), ("repetition_penalty", 0.0),
                                         ("max_new_tokens", 1), ("max_new_tokens", 8193), ("seed", -1)])
def test_out_of_range_values_name_the_field(field, value):
    """The error carries the field (`param`), for the HTTP envelope: nobody parses it out of the message."""
    with pytest.raises(SamplingError) as info:
        resolve_sampling(SamplingParams(**{field: value}), GEN)
    assert info.value.param == field and str(info.value).startswith(f"{field} must be ")


def test_server_defaults_come_between_the_request_and_the_checkpoint():
    defaults = SamplingDefaults(temperature=0.5, top_k=7)
    r = resolve_sampling(SamplingParams(top_k=3, seed=1), GEN, defaults)
    assert (r.temperature, r.top_k, r.top_p, r.seed) == (0.5, 3, 1.0, 1)


def row_warpers(temperature, top_k, top_p, vocab) -> RowWarpers:
    """RowWarpers of rows with these parameters ([B] tensors each)."""
    warpers = RowWarpers(len(temperature), vocab, "cpu")
    for row, params in enumerate(zip(temperature.tolist(), top_k.tolist(), top_p.tolist())):
        warpers.set_row(row, *params)
    return warpers


def draw(logits, temperature, top_k, top_p, seeds, counters, stream, paths=None):
    """warp_and_sample for rows at (seeds, counters) on `stream`, running `paths` (default: what the rows need)."""
    warpers, rows = row_warpers(temperature, top_k, top_p, logits.shape[-1]), slice(0, logits.shape[0])
    paths = warpers.paths_of(rows) if paths is None else paths
    return warp_and_sample(logits, warpers.rows(rows), noise_keys(seeds, counters)[:, stream], paths)


def one_row_sampler(params) -> BatchSampler:
    sampler = BatchSampler(1, talker_vocab=3072, audio_vocab=2048, eos_id=2150, device="cpu")
    sampler.set_row(0, params)
    return sampler


def sample_c0(sampler: BatchSampler, logits: torch.Tensor) -> int:
    """The one row's c0 from talker logits [1, V], as a step draws it."""
    rows = slice(0, 1)
    talker_paths, _ = sampler.paths(rows)
    return sampler.sample_talker(logits, rows, sampler.noise_keys(rows)[:, 0], talker_paths).item()


def test_talker_processing_order():
    params = [resolve_sampling(SamplingParams(temperature=0, repetition_penalty=2.0, seed=0), GEN)]
    sampler = one_row_sampler(params[0])
    logits = torch.full((1, 3072), -5.0)
    logits[0, 2150] = 100.0   # EOS is best but forbidden for the first 2 tokens
    logits[0, 2500] = 90.0    # suppressed control id
    logits[0, 7] = 3.0
    logits[0, 9] = 2.0
    assert sample_c0(sampler, logits) == 7
    # 7 was generated: its positive logit is divided by the penalty (3 -> 1.5) and 9 wins
    assert sample_c0(sampler, logits) == 9
    # after two tokens EOS is allowed
    assert sample_c0(sampler, logits) == 2150
    negative = torch.full((1, 3072), -5.0)
    negative[0, 9] = -1.0     # generated before: multiplied by the penalty -> -2
    negative[0, 11] = -1.5
    assert sample_c0(sampler, negative) == 11


def test_top_k_and_top_p_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2, 1)
    seeds = torch.tensor([0, 1])
    seen_k, seen_p = set(), set()
    for step in range(300):
        ids = draw(logits, torch.tensor([1.0, 1.0]), torch.tensor([2, 0]), torch.tensor([1.0, 0.7]), seeds,
                   torch.tensor([step, step]), 0, ALL_PATHS)
        seen_k.add(ids[0].item())
        seen_p.add(ids[1].item())
    assert seen_k == {0, 1}
    # probabilities 0.64, 0.24, 0.09, ...: top-p 0.7 keeps the two best (the ascending tail with mass <= 0.3 is cut)
    assert seen_p == {0, 1}


def test_temperature_zero_rows_are_greedy_in_a_mixed_batch():
    logits = torch.tensor([[1.0, 1.2, 0.9], [1.0, 1.2, 0.9]])
    seeds = torch.tensor([0, 1])

    def draw_at(step):
        return draw(logits, torch.tensor([0.0, 5.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), seeds,
                    torch.tensor([step, step]), 0, ALL_PATHS)
    assert {draw_at(step)[1].item() for step in range(200)} == {0, 1, 2}
    for step in range(20):
        assert draw_at(step)[0].item() == 1


def test_a_small_top_k_samples_among_candidates_as_the_sorted_vocabulary_would():
    """The candidate path (0 < top_k <= CANDIDATES) draws what the whole sorted vocabulary draws, top-p included."""
    generator = torch.Generator().manual_seed(0)
    for step in range(32):
        scores = torch.randn(64, 3072, generator=generator) * 3
        scores[:, 2048:] = float("-inf")   # suppressed ids, as the talker's are
        top_k = torch.randint(1, CANDIDATES + 1, (64,), generator=generator)
        top_p = torch.where(torch.rand(64, generator=generator) < 0.5, 1.0,
                            torch.rand(64, generator=generator) * 0.9 + 0.05)
        seeds, counters = torch.randint(0, 2 ** 62, (64,), generator=generator), torch.full((64,), step)
        keys = noise_keys(seeds, counters)[:, 0]
        warpers = row_warpers(torch.ones(64), top_k, top_p, 3072).rows(slice(0, 64))
        assert torch.equal(_sample_candidates(scores, warpers, keys), _sample_sorted(scores, warpers, keys))


def test_a_rows_draw_does_not_depend_on_the_paths_its_batch_needs():
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(1))
    temperature, top_p = torch.tensor([0.9, 0.9, 0.0, 0.9]), torch.tensor([0.8, 1.0, 1.0, 1.0])
    top_k, seeds, counters = torch.tensor([50, 0, 0, 500]), torch.arange(4), torch.full((4,), 7)
    assert row_warpers(temperature, top_k, top_p, 2048).paths_of(slice(0, 4)) == ALL_PATHS
    batched = draw(logits, temperature, top_k, top_p, seeds, counters, 3)
    for row in range(4):
        one = slice(row, row + 1)
        assert row_warpers(temperature[one], top_k[one], top_p[one], 2048).paths_of(slice(0, 1)) != ALL_PATHS
        assert draw(logits[one], temperature[one], top_k[one], top_p[one], seeds[one], counters[one],
                    3).item() == batched[row].item()


def test_a_rows_parameters_are_read_as_float32_on_host_and_device_alike():
    """A temperature float32 rounds to 0 is greedy (the argmax, and no sampling path for it on the host); a top-p it
    rounds to 1 is off; a top-k past the vocabulary keeps every id. Each row's paths are its own."""
    warpers = RowWarpers(4, 2048, "cpu")
    warpers.set_row(0, 1e-50, 50, 1.0)
    warpers.set_row(1, 0.9, 50, 0.999999999)
    warpers.set_row(2, 0.9, 5000, 0.5)
    warpers.set_row(3, 0.9, 0, 1.0)
    assert [warpers.paths_of(slice(row, row + 1)) for row in range(4)] == [GREEDY, CANDIDATES_ONLY, SORTED_ONLY,
                                                                           SORTED_ONLY]
    rows = warpers.rows(slice(0, 4))
    assert rows.divisor[:, 0].tolist() == [1.0] + [torch.tensor(0.9).item()] * 3
    assert rows.top_p[1].item() == math.inf and rows.kth[2].item() == 2047 and rows.kth[3].item() == 2047
    logits = torch.randn(1, 2048, generator=torch.Generator().manual_seed(3))
    key = noise_keys(torch.tensor([5]), torch.tensor([0]))[:, 1]
    assert warp_and_sample(logits, warpers.rows(slice(0, 1)), key, ALL_PATHS).item() == logits.argmax().item()


def test_noise_is_exponential_and_a_function_of_seed_counter_and_stream():
    seeds = torch.tensor([7, 7, 2 ** 62 + 5, 7])
    counters = torch.tensor([3, 3, 3, 4])
    noise = exponential_noise(seeds, counters, 1, 4096)
    torch.testing.assert_close(noise[0], noise[1], rtol=0, atol=0)          # same key → same draw, any row
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[3])
    assert not torch.equal(noise[0], exponential_noise(seeds, counters, 2, 4096)[0])
    torch.testing.assert_close(noise[:1], exponential_noise(seeds[:1], counters[:1], 1, 4096), rtol=0, atol=0)
    many = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 0, 4096)
    assert abs(many.mean().item() - 1.0) < 0.02 and abs(many.std().item() - 1.0) < 0.03  # Exp(1): mean = std = 1
    assert (many > 0).all() and torch.isfinite(many).all()


def test_noise_keys_and_id_hashes_are_pinned():
    """A seeded request draws the same noise on every revision and machine (integer arithmetic, exact anywhere):
    the values of revision 1491c82."""
    keys = noise_keys(torch.tensor([0, 7, 2 ** 62 + 5]), torch.tensor([0, 3, 1000]))
    assert keys[:, [0, 1, 15]].tolist() == [[0, 1461123477, 2635596729], [3678609685, 4072529239, 1783278900],
                                            [3480379525, 2917715232, 2452525159]]
    assert hash_ids(torch.tensor([0, 1, 2047, 3071])).tolist() == [0, 2654435769, 496389703, 4219286087]


# seed 2124's talker draw at token 0 has all 24 noise bits set for vocab id 2518, a suppressed id (found by search):
# the uniform rounded to 1.0 in float32, its noise was 0, and 0 / 0 = NaN won the argmax (the fuzz finding of issue 10)
TOP_BITS_SEED, TOP_BITS_ID = 2124, 2518


def test_noise_is_positive_where_all_its_bits_are_set():
    noise = exponential_noise(torch.tensor([TOP_BITS_SEED]), torch.tensor([0]), 0, 3072)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert noise[0, TOP_BITS_ID] == noise.min()   # the cell is still the smallest draw, not resampled


@pytest.mark.parametrize("top_k", [0, 2])
def test_a_suppressed_id_is_never_sampled(top_k):
    params = [resolve_sampling(SamplingParams(temperature=1.0, top_k=top_k, seed=TOP_BITS_SEED), GEN)]
    sampler = one_row_sampler(params[0])
    c0 = sample_c0(sampler, torch.randn(1, 3072, generator=torch.Generator().manual_seed(0)))
    assert c0 < 2048 or c0 == 2150


def test_token_limit_rule():
    assert token_limit(8192, 5) == 192
    assert token_limit(8192, 40) == 480
    assert token_limit(100, 40) == 100
    assert token_limit(8192, 5, cap_floor=None) == 8192


def test_frame_cap_ends_a_runaway_utterance_with_length():
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"))
    # "Hi." is 2 text tokens: limit max(20, 24) = 24 tokens -> 23 frames, although generation_config allows 8192
    result = synthesize(tts, [SynthesisRequest(text="Hi.", voice="ryan", language="english",
                                               sampling=SamplingParams(temperature=0, repetition_penalty=1.0))],
                        token_cap_floor=20)[0]
    assert result.codes.shape[0] == 23 and result.finish_reason == "length"
    longer = synthesize(tts, [SynthesisRequest(text="Hi.", voice="ryan", language="english", sampling=SamplingParams(
        temperature=0, repetition_penalty=1.0, max_new_tokens=40))], token_cap_floor=None)[0]
    assert longer.codes.shape[0] > 23


def test_the_noise_hash_products_are_the_overflow_free_ones_bit_for_bit():
    """`_mul32` takes one int64 product that wraps (its low 32 bits kept) where the overflow-free form split c into
    16-bit halves: the same bits over the whole uint32 range, contiguous, strided and small tensors alike (the
    vectorized and the scalar loops), so every seeded draw is as before."""
    from omni_tts.models.qwen3_tts.sampling import _MASK32, _mul32

    def overflow_free(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32

    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2**32, (1_000_000,), generator=generator, dtype=torch.int64)
    x[:4] = torch.tensor([0, 1, 2**32 - 1, 2**31])
    for c in (0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9, 2**32 - 1):
        for values in (x, x[::3], x.view(1000, -1)[:, :7]):
            assert torch.equal(_mul32(values, c), overflow_free(values, c))
