"""The fused kernels (fused_kernels.py, Triton; here in Triton's interpreter on the CPU) against their plain
references, the layer code they replace, on random inputs, in fp32 and bf16.

Tolerances: fp32 sums may be taken in another order (the variance, the attention's dot products): relative 1e-5.
bf16: every rounding point of the plain ops is kept, so a value differs only where the fp32 variance, in another
summation order, moves a result across a bf16 rounding boundary: one bf16 step (2^-8 relative) at most, in at most
1 % of the values (none, on the machine these were written on), and the residual sums (one rounding of an exact
fp32 sum) are bit for bit. What a GPU computes is checked on the device by
benchmarks/gpu_checks.py."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from conftest import FIXTURES
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.lora import read_adapter
from omni_tts.models.qwen3_tts.layers import Attention, DecoderLayer, RMSNorm, causal_mask, rope_cos_sin
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_adapter
from omni_tts.models.qwen3_tts.sampling import CANDIDATES_ONLY, RowWarpers, noise_keys, warp_and_sample
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams
from omni_tts.models.qwen3_tts.talker import import_fused_kernels

fused_kernels = pytest.importorskip("omni_tts.models.qwen3_tts.fused_kernels")

CONFIG = Qwen3TTSConfig.load(str(FIXTURES / "tiny-custom-voice")).talker
DTYPES = [torch.float32, torch.bfloat16]


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within what the dtype's summation order can move (module doc), relative to each value and, where sums
    cancel, to the tensor's largest value."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol = 1e-5 if actual.dtype == torch.float32 else 2.0 ** -8
    if actual.dtype == torch.bfloat16:   # the rounding points kept: almost every value bit for bit (a kernel
        assert (actual != expected).float().mean() <= 0.01   # that drops them differs in 20-90 % of its values)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol,
                               atol=rtol * expected.float().abs().max().item())


def random_module(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, mean=0.0 if parameter.dim() > 1 else 1.0, std=0.3)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 48])   # 48: not a power of two, the kernel's masked lanes
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_equals_the_add_and_the_norm(dtype, width, with_residual):
    norm = random_module(RMSNorm(width, 1e-6), dtype, seed=width)
    x = (torch.randn(3, 5, width) * 4).to(dtype)
    residual = torch.randn(3, 5, width).to(dtype) if with_residual else None
    expected_out, expected_sum = norm.add_norm(x, residual)
    out, total = fused_kernels.add_rms_norm(x.clone(), residual, norm.weight, norm.eps)
    assert torch.equal(total, expected_sum)   # the residual stream is bit for bit
    assert_near(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_times_up(dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(4, 3, 2 * 96) * 3).to(dtype)   # 96: a block with masked lanes
    gate, up = gate_up.chunk(2, dim=-1)
    assert_near(fused_kernels.silu_mul(gate_up), F.silu(gate) * up)


def attention(dtype: torch.dtype) -> Attention:
    attn = random_module(Attention(CONFIG), dtype, seed=3)
    attn.pack_projections()
    return attn


def run_qk(attn: Attention, x: torch.Tensor, positions: torch.Tensor, slots: int | torch.Tensor, fused: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and both caches after writing x's keys at `slots`, by the kernel or the plain ops."""
    b = x.shape[0]
    torch.manual_seed(8)   # the same caches for either
    k_cache = torch.randn(b, CONFIG.num_key_value_heads, 12, CONFIG.head_dim).to(x.dtype)  # slots not written stay
    v_cache = torch.randn_like(k_cache)
    cos, sin = rope_cos_sin(positions, CONFIG.head_dim, CONFIG.rope_theta, x.dtype)
    if fused:
        qkv = F.linear(x, attn.qkv_weight)
        q = fused_kernels.qk_norm_rope(qkv, attn.num_heads, attn.num_kv_heads, attn.q_norm.weight, attn.k_norm.weight,
                                       attn.q_norm.eps, cos, sin, k_cache, v_cache, slots)
    else:
        q = attn._plain_q_and_cache(x, cos, sin, k_cache, v_cache, slots, None)
    return q, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_writes_what_the_plain_ops_write_for_a_prompt(dtype):
    attn = attention(dtype)
    torch.manual_seed(4)
    x = torch.randn(2, 5, CONFIG.hidden_size).to(dtype)
    start = 3   # keys at slots 3..7 (the code predictor's later positions, a prefill's 0..)
    positions = torch.arange(start, start + 5).expand(2, 5)
    for fused_value, plain_value in zip(run_qk(attn, x, positions, start, True), run_qk(attn, x, positions, start, False)):
        assert_near(fused_value, plain_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_writes_each_rows_key_at_its_own_slot(dtype):
    attn = attention(dtype)
    torch.manual_seed(5)
    x = torch.randn(3, 1, CONFIG.hidden_size).to(dtype)
    slots = torch.tensor([0, 7, 11])   # a decode step: each row at its own length
    fused, plain = run_qk(attn, x, slots[:, None], slots, True), run_qk(attn, x, slots[:, None], slots, False)
    for fused_value, plain_value in zip(fused, plain):
        assert_near(fused_value, plain_value)
    assert not torch.equal(fused[1][1, :, 7], run_qk(attn, x, slots[:, None], torch.tensor([0, 6, 11]), True)[1][1, :, 7])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode rows", "code predictor frame", "prompt"])
def test_attention_equals_sdpa_over_the_keys_the_mask_allows(dtype, case):
    """Against SDPA in fp32 with the plain path's mask (each query's keys up to its slot), rounded once to the
    dtype: the kernel works in fp32 throughout (SDPA's own bf16 kernels round in other places, and differ as much)."""
    torch.manual_seed(10)
    heads, kv_heads, head_dim, num_slots = 4, 2, 32, 80   # 80 slots: two key blocks, the second partly masked
    b, length, slots = {"decode rows": (3, 1, torch.tensor([0, 63, 79])), "code predictor frame": (3, 2, 4),
                        "prompt": (2, 5, 0)}[case]
    q = torch.randn(b, heads, length, head_dim).to(dtype)
    k_cache, v_cache = (torch.randn(b, kv_heads, num_slots, head_dim).to(dtype) for _ in range(2))
    query_slot = slots[:, None] if isinstance(slots, torch.Tensor) else torch.arange(slots, slots + length)[None]
    mask = (torch.arange(num_slots)[None, None, :] <= query_slot.expand(b, length)[..., None])[:, None]
    expected = F.scaled_dot_product_attention(q.float(), k_cache.float(), v_cache.float(), attn_mask=mask,
                                              enable_gqa=True)
    expected = expected.transpose(1, 2).reshape(b, length, heads * head_dim)
    out = fused_kernels.attention(q, k_cache, v_cache, slots)
    assert out.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 2.0 ** -8   # bf16: the one rounding of the output
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def run_layer(kernels, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One random layer (the same weights for every dtype, rounded to it; on `kernels` or the plain ops) on fixed
    random inputs at a code predictor's positions (a shared, broadcast RoPE table): (its MLP output, the running
    sum, the caches) in fp32."""
    layer = random_module(DecoderLayer(CONFIG), dtype, seed=6)
    layer.self_attn.pack_projections()
    layer.mlp.pack_projections()
    for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp):
        module.kernels = kernels
    torch.manual_seed(7)
    x, residual = (torch.randn(2, 4, CONFIG.hidden_size).to(dtype) for _ in range(2))
    cos, sin = rope_cos_sin(torch.arange(4)[None], CONFIG.head_dim, CONFIG.rope_theta, dtype)   # [1, 1, 4, D]
    caches = torch.zeros(2, 2, CONFIG.num_key_value_heads, 4, CONFIG.head_dim, dtype=dtype)
    branch, total = layer(x, residual, cos, sin, caches[0], caches[1], 0,
                          causal_mask(torch.ones(2, 4, dtype=torch.bool), 0, 4))
    return branch.float(), total.float(), caches.float()


def test_a_layer_on_the_fused_kernels_equals_the_plain_layer_in_fp32():
    for fused_value, plain_value in zip(run_layer(fused_kernels, torch.float32), run_layer(None, torch.float32)):
        assert_near(fused_value, plain_value)


def test_a_bf16_layer_on_the_fused_kernels_is_as_close_to_fp32_as_the_plain_bf16_layer():
    """bf16 has no one right answer for attention (SDPA's kernels round in different places; the fused one rounds
    its output once): the fused layer's error against the same layer in fp32 is no larger than the plain ops'."""
    exact = run_layer(None, torch.float32)
    fused, plain = run_layer(fused_kernels, torch.bfloat16), run_layer(None, torch.bfloat16)
    for fused_value, plain_value, exact_value in zip(fused, plain, exact):
        fused_error, plain_error = ((value - exact_value).norm() / exact_value.norm()
                                    for value in (fused_value, plain_value))
        assert fused_error <= plain_error * 1.1 + 1e-3, (fused_error, plain_error)


def test_a_candidates_draw_in_one_kernel_draws_the_plain_draws_ids():
    """512 rows over a 2,048-id vocabulary, each with its own temperature, top-k (1..64), top-p and seed, and some
    near-ties: the fused draw picks what the plain draw picks. Its float steps (exp, the cumsum, log) may round in
    another order than PyTorch's, which can only change a pick whose race is tied within a rounding: on random
    logits, none of these 512 (checked: a kernel that skips the top-p cut, or hashes the next id, fails here)."""
    torch.manual_seed(9)
    rows, vocab = 512, 2048
    logits = torch.randn(rows, vocab) * torch.rand(rows, 1) * 6
    logits[::7, 1] = logits[::7, 0]   # exact ties among the best
    warpers = RowWarpers(rows, vocab, "cpu")
    for row in range(rows):
        warpers.set_row(row, float(torch.rand(()) * 1.5 + 0.05), int(torch.randint(1, 65, ())),
                        float(torch.rand(())) if row % 3 else 1.0)
    keys = noise_keys(torch.randint(0, 2 ** 62, (rows,)), torch.randint(0, 5000, (rows,)))[:, 5]
    table = warpers.rows(slice(0, rows))
    plain = warp_and_sample(logits, table, keys, CANDIDATES_ONLY)
    fused = warp_and_sample(logits, table, keys, CANDIDATES_ONLY, fused_kernels)
    assert torch.equal(fused, plain)
    assert (plain != logits.argmax(-1)).sum() > rows // 4   # the draws sample: not the greedy ids


def test_a_talker_step_on_the_fused_kernels_draws_the_plain_steps_codes(monkeypatch):
    """Two static-shape steps of two sampled rows (top-k 50, the checkpoints' default) on the tiny model in fp32: the
    plain step's codes, every layer pass and draw on the kernels (none left plain). (bf16: attention rounds elsewhere
    than SDPA, which a sampled draw of random weights can amplify into other codes; the layer tests above bound it.)"""
    dtype = torch.float32
    tts = Qwen3TTS(str(FIXTURES / "tiny-custom-voice"), dtype=dtype)
    launches = Counter()
    for name in ("add_rms_norm", "qk_norm_rope", "attention", "silu_mul", "sample_candidates"):
        kernel = getattr(fused_kernels, name)
        monkeypatch.setattr(fused_kernels, name,
                            lambda *args, _kernel=kernel, _name=name: launches.update([_name]) or _kernel(*args))
    frames = []
    for kernels in (None, import_fused_kernels(dtype)):
        tts.talker.use_fused_kernels(kernels)
        engine = TalkerEngine(tts.talker, tts.config, 2, 300, 512, 64, static_shapes=True)
        for i in range(2):
            p = prepare(tts, SynthesisRequest(text=f"Sentence {i}: the quick brown fox.", voice="ryan",
                                              sampling=SamplingParams(temperature=0.9, top_k=50, seed=i)))
            engine.add_request(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens))
        outputs = engine.step()   # the prefill and a first step
        launches.clear()
        outputs += engine.step()
        frames.append([(o.request_id, o.frame.tolist()) for o in outputs])
    assert len(frames[1]) == 4 and frames[1] == frames[0]
    # the second step: the talker's forward and the code predictor's 15, each 2 layers: per forward 2 norms a layer
    # + the final norm, one q/k kernel, one attention and one SiLU·up a layer; and 16 draws, one kernel each after
    # its topk
    forwards, layers = 16, 2
    assert launches == {"add_rms_norm": forwards * (2 * layers + 1), "qk_norm_rope": forwards * layers,
                        "attention": forwards * layers, "silu_mul": forwards * layers, "sample_candidates": forwards}


def test_lora_rows_on_the_fused_kernels_draw_the_plain_steps_codes(tmp_path):
    """A row on an adapter beside a row without, fp32: the adapters add to the packed projections' parts, packed
    again for the kernels; the same greedy codes as the plain LoRA step, one graph-shaped slot bucket or not."""
    tts = Qwen3TTS(str(FIXTURES / "tiny-custom-voice"))
    adapter = read_adapter(make_random_adapter(str(tmp_path / "a"), str(FIXTURES / "tiny-custom-voice"), seed=1),
                           tts.config.talker, 16)
    frames = []
    for kernels in (None, import_fused_kernels(torch.float32)):
        tts.talker.use_fused_kernels(kernels)
        engine = TalkerEngine(tts.talker, tts.config, 2, 300, 512, 64, static_shapes=True, max_loras=1)
        engine.load_lora("a", adapter)
        for i, lora in enumerate(("a", None)):
            p = prepare(tts, SynthesisRequest(text=f"Sentence {i}: the quick brown fox.", voice="ryan",
                                              sampling=SamplingParams(temperature=0)))
            engine.add_request(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens, lora=lora))
        outputs = engine.step() + engine.step()
        frames.append([(o.request_id, o.frame.tolist()) for o in outputs])
    assert len(frames[1]) == 4 and frames[1] == frames[0]
    assert engine.runner.slot_buckets == [300]   # the fused attention: one slot bucket
