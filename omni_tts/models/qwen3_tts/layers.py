"""Qwen3 decoder building blocks shared by the talker and the code predictor.

The released config declares interleaved MRoPE, but all three position axes are the same 1-D positions, so plain
rotate-half RoPE is exact (model doc §4). Attention reads a static KV cache that the caller owns.

A stack runs its layers in the residual-stream form: each layer returns its MLP output and the running sum before
it, and the next norm adds them (`RMSNorm.add_norm`), the same ops in the same order as `x = x + branch(norm(x))`.
That form lets `DecoderStack.use_fused_kernels` replace the add and the norm by one kernel, and the rest of a
layer but its matmuls by three more (fused_kernels.py): the GPU's path. The plain ops stay the reference (and the
CPU's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint_config import DecoderLMConfig

if TYPE_CHECKING:
    from types import ModuleType

    from .lora_slots import LayerLoRA, StackLoRA


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An nn.Embedding without its N(0, 1) init: the models here are built on `meta` and then loaded (or given
    weights by random_model.py), and a normal_ on `meta` imports torch._dynamo: ~0.9 s of a stage's start."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: ModuleType | None = None   # fused_kernels, when the stack uses them

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x). With the fused kernels one kernel, and
        the sum is written over x (a branch output the layer owns)."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, bit-identical to the lines below in fp32, and half their cost where per-op
            # overhead dominates (the code predictor's 15 small forwards per frame)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerScale(nn.Module):
    """Per-channel residual-branch scale (`*_layer_scale.scale` in the speech tokenizer)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, L] -> cos, sin: [B, 1, L, head_dim] (computed in fp32 as the reference does), sin's first half
    negated: what apply_rope takes (the sign moved from each layer's rotated input to the table made once)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin = emb.sin().to(dtype)
    return emb.cos().to(dtype), torch.cat((-sin[..., :head_dim // 2], sin[..., head_dim // 2:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference's x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1), as x·cos + roll(x)·sin with `sin`'s
    first half negated (rope_cos_sin): one kernel fewer (a roll, not a negation and a concatenation), and bit for bit
    the same (a sign flip is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def pack_weights(*linears: nn.Linear) -> torch.Tensor:
    """The linears' weights (no bias) concatenated along the output, each linear's weight then a view of it."""
    packed = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(packed[start:start + rows], requires_grad=False)
        start += rows
    return packed


class KVCache:
    """Static per-layer key/value buffers: [layers, B, kv_heads, max_len, head_dim].

    Preallocated once; a forward writes its new keys at `start .. start+L` and attends over `0 .. start+L`.
    """

    def __init__(self, cfg: DecoderLMConfig, batch_size: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def rows(self, start: int, stop: int) -> "KVCache":
        """A view of rows start..stop-1 (no copy): writes through the view land in this cache."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        return view

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Move a request's first `length` slots from row src to row dst (engine compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None   # pack_projections()
        self.kernels: ModuleType | None = None          # fused_kernels, when the stack uses them (packed q/k/v)

    def pack_projections(self) -> None:
        """q, k and v in one matmul (two kernels fewer a layer, and one read of the input): their weights concatenated
        once, the three linears' weights made views of it (no second copy)."""
        self.qkv_weight = pack_weights(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: int | torch.Tensor, mask: torch.Tensor,
                lora: "LayerLoRA | None" = None) -> torch.Tensor:
        # x: [B, L, hidden]; k_cache/v_cache: [B, kvh, S, D]; mask: [B, 1, L, E] bool (True = attend) over slots 0..E-1
        # slots: int = every row writes its L keys at slots..slots+L-1; [B] tensor = row b writes its one key at slots[b]
        # lora: each row's adapter added to the linears (lora_slots.py); None: the plain linears, no extra kernel
        if self.kernels is not None:   # the mask's rule is the kernel's (fused_kernels.attention)
            qkv = F.linear(x, self.qkv_weight)
            if lora is not None:   # the rows' adapters add to q, k and v apart: packed again for the kernel
                qkv = torch.cat(lora.add("self_attn.qkv", x, qkv.split(
                    (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features), dim=-1)), dim=-1)
            q = self.kernels.qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                          self.k_norm.weight, self.q_norm.eps, cos, sin, k_cache, v_cache, slots)
            out = self.kernels.attention(q, k_cache, v_cache, slots)
            return self.o_proj(out) if lora is None else lora.add("self_attn.o", out, (self.o_proj(out),))[0]
        b, length, _ = x.shape
        end = mask.shape[-1]
        q = self._plain_q_and_cache(x, cos, sin, k_cache, v_cache, slots, lora)
        out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(b, length, self.num_heads * self.head_dim)
        return self.o_proj(out) if lora is None else lora.add("self_attn.o", out, (self.o_proj(out),))[0]

    def _plain_q_and_cache(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: int | torch.Tensor, lora: "LayerLoRA | None") -> torch.Tensor:
        """q/k/v projections (+ the rows' adapters), q/k norms and RoPE, k and v written into the caches: the plain
        ops that fused_kernels.qk_norm_rope replaces. Returns q [B, heads, L, D]."""
        b, length, _ = x.shape
        if self.qkv_weight is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = F.linear(x, self.qkv_weight).split(
                (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features), dim=-1)
        if lora is not None:
            q, k, v = lora.add("self_attn.qkv", x, (q, k, v))
        q = self.q_norm(q.view(b, length, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(slots, int):
            k_cache[:, :, slots:slots + length] = k
            v_cache[:, :, slots:slots + length] = v
        else:
            rows = torch.arange(b, device=x.device)
            k_cache[rows, :, slots] = k[:, :, 0]
            v_cache[rows, :, slots] = v[:, :, 0]
        return q


class MLP(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None   # pack_projections()
        self.kernels: ModuleType | None = None              # fused_kernels, when the stack uses them (packed)

    def pack_projections(self) -> None:
        """gate and up in one matmul (one kernel fewer a layer), as Attention's."""
        self.gate_up_weight = pack_weights(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, lora: "LayerLoRA | None" = None) -> torch.Tensor:
        if self.kernels is not None:
            gate_up = F.linear(x, self.gate_up_weight)
            if lora is None:
                return self.down_proj(self.kernels.silu_mul(gate_up))
            h = self.kernels.silu_mul(torch.cat(lora.add("mlp.gate_up", x, gate_up.chunk(2, dim=-1)), dim=-1))
            return lora.add("mlp.down", h, (self.down_proj(h),))[0]
        if self.gate_up_weight is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        if lora is None:
            return self.down_proj(F.silu(gate) * up)
        gate, up = lora.add("mlp.gate_up", x, (gate, up))
        h = F.silu(gate) * up
        return lora.add("mlp.down", h, (self.down_proj(h),))[0]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slots: int | torch.Tensor, mask: torch.Tensor,
                lora: "LayerLoRA | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, and residual the running sum before it (None for the first layer: x
        is the stack's input). Returns this layer's (MLP output, running sum before it)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(
            self.self_attn(h, cos, sin, k_cache, v_cache, slots, mask, lora), residual)
        return self.mlp(h, lora), residual


class DecoderStack(nn.Module):
    """Layers + final norm of a Qwen3 decoder (`model.layers.*`, `model.norm`); embeddings live in the owner."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pack_projections(self) -> None:
        """Every layer's q/k/v and gate/up matmuls packed (Attention.pack_projections): 3 kernels fewer a layer."""
        for layer in self.layers:
            layer.self_attn.pack_projections()
            layer.mlp.pack_projections()

    def use_fused_kernels(self, kernels: "ModuleType | None") -> None:
        """Run the layers with `kernels` (fused_kernels; after pack_projections), or the plain ops (None). A forward
        with LoRA rows adds their adapters to the packed projections' parts and packs them again (a concatenation
        each) for the kernels."""
        assert kernels is None or self.layers[0].self_attn.qkv_weight is not None, "pack_projections first"
        for layer in self.layers:
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp):
                module.kernels = kernels
        self.norm.kernels = kernels

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor | None, cache: KVCache, slots: int | torch.Tensor,
                   mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                   lora: "StackLoRA | None" = None) -> torch.Tensor:
        # x: [B, L, hidden]; positions: [B, L] RoPE positions, or rope: their (cos, sin) computed by the caller;
        # lora: the rows' adapters (None: no LoRA rows); returns the post-norm hidden states [B, L, hidden]
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta,
                                                                x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, cache.k[i], cache.v[i], slots, mask,
                                None if lora is None else lora.layer(i))
        return self.norm.add_norm(x, residual)[0]


def causal_mask(key_valid: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[B, 1, length, start+length] bool: causal over cache slots, restricted to valid (non-padding) keys.

    A padding query may attend to itself so that no softmax row is empty (an empty row gives NaN, and NaN values
    would leak through masked-out keys of the next layer as 0 * NaN)."""
    end = start + length
    q_slot = torch.arange(start, end, device=key_valid.device)[:, None]
    k_slot = torch.arange(end, device=key_valid.device)[None, :]
    causal = k_slot <= q_slot
    mask = causal[None] & key_valid[:, None, :end]
    mask |= (k_slot == q_slot)[None]
    return mask[:, None]
