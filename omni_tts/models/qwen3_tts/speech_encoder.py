"""Speech-tokenizer encoder (wave → codes) for Base voice cloning, in plain PyTorch (model doc §11).

The released speech tokenizer embeds a Mimi encoder (SEANet convs → causal transformer → stride-2 downsample → split
RVQ). The reference runs it through transformers' `MimiModel`; these files (mimi_*.py) re-implement the encoder side
so that the result does not depend on the installed transformers version (the class layout and key names of
transformers' Mimi changed in 5.x). State-dict names are the checkpoint's `encoder.*` keys with that prefix stripped.

Attention is plain causal, with **no sliding window** by default: that is what the reference computes
(transformers 4.57.x builds a full causal mask for Mimi's SDPA/eager attention and ignores `sliding_window`),
whereas transformers 5.x applies the 250-frame window. The two differ only for references longer than
`sliding_window` frames at 25 Hz (10 s released); `use_sliding_window=True` gives the windowed variant.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .mimi_config import MimiEncoderConfig
from .mimi_quantizer import SplitResidualVQ
from .mimi_seanet import MimiConv, SEANetEncoder
from .mimi_transformer import Transformer


class SpeechEncoder(nn.Module):
    """Mimi encoder: 24 kHz audio → the first `num_codebooks` RVQ codes per 80 ms frame."""

    def __init__(self, config: MimiEncoderConfig, num_codebooks: int = 16, use_sliding_window: bool = False) -> None:
        super().__init__()
        if not config.num_semantic_quantizers <= num_codebooks <= config.num_quantizers:
            raise ValueError(f"num_codebooks must be in [{config.num_semantic_quantizers}, {config.num_quantizers}], "
                             f"got {num_codebooks}")
        self.config, self.num_codebooks = config, num_codebooks
        self.encoder = SEANetEncoder(config)
        self.encoder_transformer = Transformer(config, use_sliding_window)
        stride = config.downsample_stride
        # edges repeat the last latent (replicate), unlike the SEANet convs' zero padding
        self.downsample = (MimiConv(config.hidden_size, config.hidden_size, 2 * stride, stride=stride, bias=False,
                                    causal=config.use_causal_conv, pad_mode="replicate") if stride > 1 else None)
        self.quantizer = SplitResidualVQ(config)

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def num_frames(self, num_samples: int) -> int:
        """Code frames for a clip: ceil(samples / 1920) released."""
        return -(-num_samples // self.samples_per_frame)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        """input_values [B, 1, samples] (one unpadded clip per row) → codes [B, num_codebooks, frames] int64."""
        x = self.encoder(input_values.to(self.encoder.layers[0].conv.weight.dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            x = self.downsample(x)
        return self.quantizer.encode(x.float(), self.num_codebooks)

    @torch.no_grad()
    def encode(self, wav24k: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Mono 24 kHz float audio [samples] → codes [T_ref, num_codebooks] int64 on CPU, T_ref = ceil(n / 1920).

        Same as the reference's EncodecFeatureExtractor + `encode` for a single clip: the samples as float32,
        an all-ones padding mask, codes trimmed to the frames the clip covers.
        """
        wav = torch.as_tensor(np.asarray(wav24k, dtype=np.float32) if not isinstance(wav24k, torch.Tensor)
                              else wav24k.float())
        if wav.dim() != 1:
            raise ValueError(f"expected mono audio of shape [samples], got shape {tuple(wav.shape)}")
        if wav.numel() == 0:
            raise ValueError("cannot encode empty reference audio")
        if not torch.isfinite(wav).all():
            raise ValueError("reference audio contains non-finite samples")
        device = next(self.parameters()).device
        codes = self.forward(wav.to(device)[None, None])[0]
        return codes[:, : self.num_frames(wav.numel())].transpose(0, 1).contiguous().cpu()
