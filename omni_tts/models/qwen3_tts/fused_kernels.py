"""The talker step's fused kernels (Triton): what a CUDA-graphed step replays ~10 kernels a layer with, not ~50.

A layer's plain ops in bf16 are ~50 kernels, each launch-bound at these sizes (an RMSNorm alone is 8: upcast, square,
mean, add, rsqrt, multiply, downcast, weight). Four kernels replace all but its four matmuls:
- `add_rms_norm`: the residual add and the next RMSNorm;
- `qk_norm_rope`: the per-head q/k RMSNorm, RoPE and the key/value cache write, from the packed q/k/v projection;
- `silu_mul`: SiLU(gate) · up, from the packed gate/up projection;
- `attention`: causal attention over the cache for the step's short queries (a decode row, the code predictor's
  frame), in fp32 with the output rounded once, written in the o projection's layout.
The first three keep the reference's numerics: fp32 variance and arithmetic, and the bf16 rounding after every op where the
plain PyTorch ops round (a fused kernel that dropped those rounding points cost another server audible quality,
compounded over the code predictor's 15 passes). The rounding is done on the bits (`_round`), which is exact on a
GPU and in Triton's interpreter alike (the interpreter's bf16 cast truncates), so the CPU tests the same values a
GPU computes. And one for the step's 16 draws:
- `sample_candidates`: a draw among a row's top-k candidates (top-k mask, softmax, top-p, the counter-based noise,
  the race): ~25 kernels of sampling.py's plain path in one.
Each kernel's plain reference is the code it replaces (layers.py, sampling.py); tests/models/test_fused_kernels.py
holds them equal on random inputs, in the interpreter (`TRITON_INTERPRET=1`). fp32 and bf16 only (`supports`); the
CPU runs the plain ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype) -> bool:
    return dtype in DTYPES


@triton.jit
def _round(x, ROUND_BF16: tl.constexpr):
    """fp32 → the nearest bf16 (ties to even), kept in fp32: where a bf16 PyTorch op rounds its result."""
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n, eps, HAS_RESIDUAL: tl.constexpr,
                         ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + residual, ROUND_BF16)
        tl.store(x_ptr + row * n + offs, x.to(x_ptr.dtype.element_ty), mask=mask)   # the sum, in x's place
    variance = tl.sum(x * x, axis=0) / n
    normed = _round(x * tl.rsqrt(variance + eps), ROUND_BF16)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, _round(weight * normed, ROUND_BF16).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual: [..., n] contiguous (residual None: no add). The sum
    is written over x (a branch output the caller owns), so the step allocates nothing for it."""
    n = x.shape[-1]
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(x.numel() // n,)](
        x, x if residual is None else residual, weight, out, n, eps, HAS_RESIDUAL=residual is not None,
        ROUND_BF16=x.dtype == torch.bfloat16, BLOCK=triton.next_power_of_2(n))
    return out, x


@triton.jit
def _norm_rope(x, x_rolled, weight_ptr, dims, rolled, cos, sin, eps, HEAD_DIM: tl.constexpr,
               ROUND_BF16: tl.constexpr):
    """Heads [H, D] → RMSNorm(·) · cos + roll(RMSNorm(·)) · sin, each op rounded as the plain ops round.
    x_rolled: the heads' raw values at the rolled dims (normalised with the head's own variance)."""
    scale = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    weight = tl.load(weight_ptr + dims).to(tl.float32)[None, :]
    weight_rolled = tl.load(weight_ptr + rolled).to(tl.float32)[None, :]
    normed = _round(weight * _round(x * scale, ROUND_BF16), ROUND_BF16)
    normed_rolled = _round(weight_rolled * _round(x_rolled * scale, ROUND_BF16), ROUND_BF16)
    return _round(_round(normed * cos, ROUND_BF16) + _round(normed_rolled * sin, ROUND_BF16), ROUND_BF16)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                         slots_ptr, start, length, eps, cos_stride_b, cos_stride_l, cache_stride_b, cache_stride_h,
                         cache_stride_s, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, ROW_SLOTS: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
    token = tl.program_id(0)   # one program a token: all its heads at once
    b, position = token // length, token % length
    dims = tl.arange(0, HEAD_DIM)
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM   # roll by half a head: element i reads i + D/2 (mod D)
    table = b * cos_stride_b + position * cos_stride_l + dims
    cos = tl.load(cos_ptr + table).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + table).to(tl.float32)[None, :]
    row = qkv_ptr + token * (NUM_Q + 2 * NUM_KV) * HEAD_DIM
    if ROW_SLOTS:
        slot = tl.load(slots_ptr + b)
    else:
        slot = start + position

    heads = tl.arange(0, BLOCK_Q)[:, None]
    mask = heads < NUM_Q
    x = tl.load(row + heads * HEAD_DIM + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rolled = tl.load(row + heads * HEAD_DIM + rolled[None, :], mask=mask, other=0.0).to(tl.float32)
    q = _norm_rope(x, x_rolled, q_weight_ptr, dims, rolled, cos, sin, eps, HEAD_DIM, ROUND_BF16)
    tl.store(q_ptr + ((b * NUM_Q + heads) * length + position) * HEAD_DIM + dims[None, :],
             q.to(q_ptr.dtype.element_ty), mask=mask)

    heads = tl.arange(0, BLOCK_KV)[:, None]
    mask = heads < NUM_KV
    k_row = row + NUM_Q * HEAD_DIM
    x = tl.load(k_row + heads * HEAD_DIM + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rolled = tl.load(k_row + heads * HEAD_DIM + rolled[None, :], mask=mask, other=0.0).to(tl.float32)
    k = _norm_rope(x, x_rolled, k_weight_ptr, dims, rolled, cos, sin, eps, HEAD_DIM, ROUND_BF16)
    cache = b * cache_stride_b + heads * cache_stride_h + slot * cache_stride_s + dims[None, :]
    tl.store(k_cache_ptr + cache, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(k_row + (NUM_KV + heads) * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    tl.store(v_cache_ptr + cache, v, mask=mask)


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: int | torch.Tensor) -> torch.Tensor:
    """The attention's inputs from the packed projection qkv [B, L, (heads + 2 kv heads) · D] (contiguous): q
    normalised and rotated, returned [B, heads, L, D]; k normalised and rotated and v written into the caches
    [B, kv heads, S, D] at slots (an int: every row's L keys at slots..slots+L-1; a [B] tensor: row b's one key at
    slots[b], L = 1). cos, sin: [B or 1, 1, L, D], sin's first half negated (layers.rope_cos_sin)."""
    b, length, _ = qkv.shape
    head_dim = q_weight.shape[0]
    assert qkv.is_contiguous() and head_dim & (head_dim - 1) == 0, "a power-of-two head_dim (tl.arange)"
    q = torch.empty(b, num_heads, length, head_dim, device=qkv.device, dtype=qkv.dtype)
    row_slots = isinstance(slots, torch.Tensor)
    assert k_cache.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    _qk_norm_rope_kernel[(b * length,)](
        qkv, q_weight, k_weight, cos, sin, q, k_cache, v_cache, slots if row_slots else qkv, 0 if row_slots else slots,
        length, eps, cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_Q=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        ROW_SLOTS=row_slots, ROUND_BF16=qkv.dtype == torch.bfloat16)
    return q


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, out_ptr, start, length, scale, cache_stride_b,
                      cache_stride_h, cache_stride_s, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                      HEAD_DIM: tl.constexpr, ROW_SLOTS: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)   # one program a (token, q head)
    head, token = pid % NUM_Q, pid // NUM_Q
    b, position = token // length, token % length
    if ROW_SLOTS:
        last = tl.load(slots_ptr + b)
    else:
        last = start + position
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + ((b * NUM_Q + head) * length + position) * HEAD_DIM + dims).to(tl.float32)
    cache = b * cache_stride_b + (head // (NUM_Q // NUM_KV)) * cache_stride_h   # the q head's kv head (GQA)
    best = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.full([], 0.0, dtype=tl.float32)
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for first in range(0, last + 1, BLOCK_S):   # online softmax over keys 0..last, BLOCK_S at a time
        keys = first + tl.arange(0, BLOCK_S)
        valid = keys <= last
        at = cache + keys[:, None] * cache_stride_s + dims[None, :]
        k = tl.load(k_cache_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best)
        v = tl.load(v_cache_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        best = new_best
    tl.store(out_ptr + (token * NUM_Q + head) * HEAD_DIM + dims, (acc / total).to(out_ptr.dtype.element_ty))


ATTENTION_BLOCK = 64   # keys a loop iteration reads


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: int | torch.Tensor
              ) -> torch.Tensor:
    """Causal attention of q [B, heads, L, D] (contiguous) over the caches [B, kv heads, S, D]: query i of row b sees
    keys 0..its own slot (slots an int: slots + i; a [B] tensor: slots[b], L = 1), computed in fp32 (online
    softmax) and rounded once. Returns [B, L, heads · D], the o projection's input: SDPA and the transposing copy
    after it in one kernel. The masks the plain path takes say the same for every query whose output is kept: a
    decode row's keys up to its slot; the code predictor's causal frame; a right-padded prompt's real positions
    (its padding queries, thrown away, see their padding keys here)."""
    b, num_heads, length, head_dim = q.shape
    out = torch.empty(b, length, num_heads * head_dim, device=q.device, dtype=q.dtype)
    row_slots = isinstance(slots, torch.Tensor)
    assert q.is_contiguous() and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _attention_kernel[(b * length * num_heads,)](
        q, k_cache, v_cache, slots if row_slots else q, out, 0 if row_slots else slots, length, head_dim ** -0.5,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_Q=num_heads, NUM_KV=k_cache.shape[1],
        HEAD_DIM=head_dim, ROW_SLOTS=row_slots, BLOCK_S=ATTENTION_BLOCK)
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), ROUND_BF16)
    tl.store(out_ptr + row * n + cols, _round(silu * up, ROUND_BF16).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up from the packed projection gate_up [..., 2n] (contiguous; gate first) → [..., n]."""
    n = gate_up.shape[-1] // 2
    assert gate_up.is_contiguous()
    out = torch.empty(*gate_up.shape[:-1], n, device=gate_up.device, dtype=gate_up.dtype)
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(gate_up.numel() // (2 * n), triton.cdiv(n, block))](
        gate_up, out, n, ROUND_BF16=gate_up.dtype == torch.bfloat16, BLOCK=block)
    return out


@triton.jit
def _mul32(x, c):
    """(x · c) mod 2**32 in int64 (sampling._mul32: the product wraps mod 2**64, the mask keeps its low 32 bits)."""
    return (x * c) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    """sampling._mix32, murmur3's 32-bit finaliser, in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@triton.jit
def _sample_candidates_kernel(values_ptr, ids_ptr, beyond_k_ptr, top_p_ptr, keys_ptr, keys_stride, hashes_ptr,
                              out_ptr, num_candidates, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_candidates
    cell = row * num_candidates + offs
    values = tl.load(values_ptr + cell, mask=mask, other=float("-inf"))
    beyond_k = tl.load(beyond_k_ptr + cell, mask=mask, other=1) != 0
    values = tl.where(beyond_k, float("-inf"), values)
    # a row with every candidate masked (a greedy row a static step draws for anyway, then throws away) gets zeros,
    # not NaNs (the plain path's NaNs; an argmax over NaNs faults in the interpreter); any other row is unchanged: its
    # best candidate's exp(0) = 1 makes its sum >= 1
    best = tl.max(values, axis=0)
    exp = tl.exp(values - tl.where(best == float("-inf"), 0.0, best))
    total = tl.sum(exp, axis=0)
    probs = exp / tl.where(total > 0.0, total, 1.0)
    before = tl.cumsum(probs, axis=0) - probs
    probs = tl.where(before >= tl.load(top_p_ptr + row), 0.0, probs)
    ids = tl.load(ids_ptr + cell, mask=mask, other=0)
    bits = _mix32(tl.load(keys_ptr + row * keys_stride) ^ tl.load(hashes_ptr + ids, mask=mask, other=0))
    uniform = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * (2.0 ** -24), 1.0 - 2.0 ** -24)
    race = tl.where(mask, probs / -tl.log(uniform), -1.0)
    pick = tl.argmax(race, axis=0)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * num_candidates + pick))


def sample_candidates(values: torch.Tensor, ids: torch.Tensor, beyond_k: torch.Tensor, top_p: torch.Tensor,
                      keys: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """sampling._sample_candidates after its topk: values, ids [B, C] (the rows' best scores and their ids, best
    first), beyond_k [B, C], top_p [B, 1] (Warpers), keys [B] (a noise_keys column), hashes [V] (hash_ids) → the
    drawn ids [B]."""
    b, num_candidates = values.shape
    out = torch.empty(b, dtype=ids.dtype, device=ids.device)
    assert values.is_contiguous() and ids.is_contiguous() and beyond_k.stride(-1) == 1 and top_p.stride(-1) == 1
    _sample_candidates_kernel[(b,)](values, ids, beyond_k, top_p, keys, keys.stride(0), hashes, out, num_candidates,
                                    BLOCK=triton.next_power_of_2(num_candidates))
    return out
