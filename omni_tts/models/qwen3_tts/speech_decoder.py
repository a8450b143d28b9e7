"""Qwen3-TTS-12Hz speech-tokenizer decoder: 16 codebooks x T frames -> 24 kHz waveform (model doc §10).

codes [B, 16, T] -> RVQ decode [B, codebook_dim, T] -> causal conv -> windowed transformer -> 2 x (transposed conv
+ ConvNeXt), 4x -> waveform decoder (4 SnakeBeta / transposed-conv / residual-unit blocks, 480x) -> [B, T*1920].

Every layer is causal, so the decoder can run as an exact streaming decoder: each layer that looks at the past
keeps exactly the past it needs in a `DecoderStreamState` (decoder_state.py), and a chunk of F frames emits F*1920
new samples whose concatenation over chunks equals the one-pass decode. The one-pass `forward` is the same code run
on a fresh state (so the two paths cannot drift apart).

Parameter / buffer names equal the checkpoint's `decoder.*` keys without the `decoder.` prefix.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .checkpoint_config import SpeechDecoderConfig
from .decoder_convs import CausalConv1d, CausalConvTranspose1d, DecoderBlock, SnakeBeta, UpsampleStage
from .decoder_quantizer import SplitRVQ
from .decoder_state import DecoderStreamState, StateLayout
from .decoder_transformer import PreTransformer


class SpeechDecoder(nn.Module):
    """The speech-tokenizer decoder, one-pass (`forward`) and exact streaming (`decode_chunk`)."""

    def __init__(self, cfg: SpeechDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.samples_per_frame = cfg.samples_per_frame
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, kernel_size=3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(UpsampleStage(cfg.latent_dim, r) for r in cfg.upsampling_ratios)
        n_blocks = len(cfg.upsample_rates)
        dims = [cfg.decoder_dim // 2 ** i for i in range(n_blocks + 1)]
        self.decoder = nn.ModuleList([
            CausalConv1d(cfg.latent_dim, dims[0], kernel_size=7),
            *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv1d(dims[-1], 1, kernel_size=7),
        ])

        # Give every stateful layer its slot in DecoderStreamState (module registration order).
        self._convs = [m for m in self.modules() if isinstance(m, CausalConv1d) and m.history > 0]
        self._tconvs = [m for m in self.modules() if isinstance(m, CausalConvTranspose1d) and m.overlap > 0]
        for i, m in enumerate(self._convs):
            m.slot = i
        for i, m in enumerate(self._tconvs):
            m.slot = i
        for i, layer in enumerate(self.pre_transformer.layers):
            layer.self_attn.layer = i
        self.state_layout = StateLayout(
            conv=tuple((m.conv.in_channels, m.history) for m in self._convs),
            overlap=tuple((m.conv.out_channels, m.overlap) for m in self._tconvs),
            kv=(cfg.num_key_value_heads, cfg.sliding_window - 1, cfg.head_dim), num_layers=cfg.num_hidden_layers)

    def new_stream_state(self, batch_size: int = 1, device: torch.device | str | None = None,
                         dtype: torch.dtype | None = None) -> DecoderStreamState:
        """A zeroed state for `batch_size` new streams (position 0). Defaults: the weights' device and dtype."""
        weight = self.pre_conv.conv.weight
        device = weight.device if device is None else device
        return self.state_layout.zeros(batch_size, device, weight.dtype if dtype is None else dtype)

    @torch.no_grad()
    def decode_chunk(self, codes: Tensor, state: DecoderStreamState) -> Tensor:
        """Decode the next F frames of each stream: codes [B, Q, F] -> waveform [B, F * samples_per_frame].

        Updates `state` in place (positions advance by F). Rows may be at different stream offsets; all rows share
        F. The output is clamped to [-1, 1] and has the weights' dtype.
        """
        b, q, f = codes.shape
        if q != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} codebooks, got codes of shape {tuple(codes.shape)}")
        if b != state.batch_size:
            raise ValueError(f"codes batch {b} != state batch {state.batch_size}")
        if f == 0:
            return codes.new_zeros(b, 0, dtype=self.pre_conv.conv.weight.dtype)

        x = self.quantizer(codes)                             # [B, codebook_dim, F]
        x = self.pre_conv(x, state)                           # [B, latent, F]
        x = self.pre_transformer(x.transpose(1, 2), state)    # [B, F, latent]
        x = x.transpose(1, 2)                                 # [B, latent, F]
        for stage in self.upsample:
            x = stage(x, state)                               # [B, latent, F * prod(upsampling_ratios)]
        for layer in self.decoder:
            x = layer(x) if isinstance(layer, SnakeBeta) else layer(x, state)
        state.position += f
        return x.squeeze(1).clamp(-1.0, 1.0)                  # [B, F * samples_per_frame]

    @torch.no_grad()
    def forward(self, codes: Tensor, chunk_frames: int | None = None) -> Tensor:
        """One-pass decode, positions 0..T-1: codes [B, Q, T] -> waveform [B, T * samples_per_frame] in [-1, 1].

        `chunk_frames` decodes through the streaming path in chunks of that many frames: the same result (exact,
        unlike the reference's 300/25 chunked decode) with activation memory bounded by the chunk size.
        """
        state = self.new_stream_state(codes.shape[0], codes.device)
        if chunk_frames is None or chunk_frames >= codes.shape[-1]:
            return self.decode_chunk(codes, state)
        return torch.cat([self.decode_chunk(c, state) for c in codes.split(chunk_frames, dim=-1)], dim=-1)
