"""The speech decoder's windowed transformer: sliding-window causal attention over the carried keys and values."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint_config import SpeechDecoderConfig
from .decoder_state import DecoderStreamState
from .layers import LayerScale, RMSNorm, apply_rope, rope_cos_sin


class Attention(nn.Module):
    """Sliding-window causal attention over [carried keys (W-1 slots) ++ this chunk's keys]."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # heads * head_dim need not equal hidden (released: 16 x 64 = 1024 vs hidden 512)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.layer = -1  # index into DecoderStreamState.keys / values

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, F, hidden]; cos/sin: [B, 1, F, head_dim]; mask: [B, 1, F, W-1+F] (True = attend)
        b, f, _ = x.shape
        q = self.q_proj(x).view(b, f, self.n_heads, self.head_dim).transpose(1, 2)     # [B, H, F, D]
        k = self.k_proj(x).view(b, f, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KVH, F, D]
        v = self.v_proj(x).view(b, f, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        k_cache, v_cache = state.keys[self.layer], state.values[self.layer]   # [B, KVH, W-1, D]
        k = torch.cat([k_cache, k], dim=2)                                   # [B, KVH, W-1+F, D]
        v = torch.cat([v_cache, v], dim=2)
        k_cache.copy_(k[:, :, f:])  # keep the newest W-1 (already rotated at their absolute positions)
        v_cache.copy_(v[:, :, f:])

        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)  # [B, H, F, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, f, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, state: DecoderStreamState) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, state))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """Linear latent -> hidden, windowed transformer layers, RMSNorm, Linear hidden -> latent."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: Tensor, state: DecoderStreamState) -> Tensor:
        # x: [B, F, latent] -> [B, F, latent]
        f = x.shape[1]
        cached = self.cfg.sliding_window - 1
        offsets = torch.arange(f, device=x.device)
        positions = state.position[:, None] + offsets                                    # [B, F] absolute
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)

        # Key slot c of [cache ++ chunk] holds absolute position start - cached + c (cache right-aligned).
        # Query i (position start + i) sees slots c with i <= c <= i + cached (the window, itself included),
        # and only slots at positions >= 0 (the cache is not full yet near the start of the stream).
        slots = torch.arange(cached + f, device=x.device)
        rel = slots[None, :] - offsets[:, None]                                          # [F, W-1+F]
        window = (rel >= 0) & (rel <= cached)
        started = slots[None, :] >= (cached - state.position)[:, None]                   # [B, W-1+F]
        mask = (window[None] & started[:, None])[:, None]                                # [B, 1, F, W-1+F]

        x = self.input_proj(x)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, state)
        return self.output_proj(self.norm(x))
