"""Fewer kernels a step (issue 34), each against its plain reference: a layer's q/k/v and gate/up packed into one
matmul each equals the plain layer on random inputs (the same products, one matmul wider) with 3 matmuls fewer, the
packed linears' weights views of the packed one (no second copy); RoPE as a roll against a sign-folded sin table is
the reference's rotate_half form bit for bit. The goldens stay exact with both (Qwen3TTS packs at load:
tests/engine/test_synthesize.py, tests/models/test_talker_parity.py)."""
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.layers import DecoderLayer, apply_rope, causal_mask, rope_cos_sin

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "benchmarks"))
from bench_step_ops import OpCounter  # noqa: E402

CONFIG = Qwen3TTSConfig.load(str(FIXTURES / "tiny-custom-voice")).talker


def forward(layer: DecoderLayer, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer's output on a fresh cache and its matrix products (the kernels a packing saves)."""
    b, length, _ = x.shape
    cfg = CONFIG
    k_cache = torch.zeros(b, cfg.num_key_value_heads, 16, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    cos, sin = rope_cos_sin(torch.arange(length).expand(b, length), cfg.head_dim, cfg.rope_theta, x.dtype)
    mask = causal_mask(torch.ones(b, length, dtype=torch.bool), 0, length)
    with OpCounter() as counter:
        branch, residual = layer(x, None, cos, sin, k_cache, v_cache, 0, mask)
        out = branch + residual
    return out, sum(n for op, n in counter.ops.items() if op.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm))


def test_a_packed_layer_equals_the_plain_one_with_three_matmuls_fewer():
    torch.manual_seed(0)
    layer = DecoderLayer(CONFIG)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(3, 5, CONFIG.hidden_size)
    plain, plain_ops = forward(layer, x)
    weights = {name: p.clone() for name, p in layer.named_parameters()}
    layer.self_attn.pack_projections()
    layer.mlp.pack_projections()
    packed, packed_ops = forward(layer, x)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)   # fp32: the sums' order may differ by a bit
    assert (plain_ops, packed_ops) == (7, 4)   # q, k, v, o, gate, up, down → qkv, o, gate_up, down
    assert all(torch.equal(p, weights[name]) for name, p in layer.named_parameters())
    q = layer.self_attn.q_proj.weight
    assert q.data_ptr() == layer.self_attn.qkv_weight.data_ptr()   # a view, not a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_as_a_roll_is_the_references_rotate_half_bit_for_bit(dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 4, 7, 32).to(dtype)
    positions = torch.randint(0, 4000, (2, 7))
    cos, signed_sin = rope_cos_sin(positions, 32, 1_000_000.0, dtype)
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))   # the reference's tables
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin = emb.sin().to(dtype)
    assert torch.equal(cos, emb.cos().to(dtype))
    rotate_half = torch.cat((-x[..., 16:], x[..., :16]), dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), x * cos + rotate_half * sin)
