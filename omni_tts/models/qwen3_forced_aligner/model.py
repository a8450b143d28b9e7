"""Qwen3-ForcedAligner in plain PyTorch: audio encoder → audio tokens in the prompt → a causal Qwen3 decoder read as
a classifier: at every `<timestamp>` token the head picks one of `classify_num` classes of `timestamp_ms` each.

One forward, no generation: a batch of prompts is right-padded and masked, each clip encoded on its own.
"""
from __future__ import annotations

import torch
from torch import nn

from ..qwen3_tts.layers import DecoderStack, KVCache, causal_mask, embedding
from ..qwen3_tts.weights import load_strict, read_tensors, resolve_model_dir, safetensors_files
from .checkpoint_config import AlignerConfig
from .encoder import AudioEncoder


class ForcedAlignerModel(nn.Module):
    """Weights under `thinker.` (`audio_tower.*`, `model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head`)."""

    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = DecoderStack(cfg.text)
        self.model.embed_tokens = embedding(cfg.text.vocab_size, cfg.text.hidden_size)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)

    @classmethod
    def load(cls, model: str, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> "ForcedAlignerModel":
        model_dir = resolve_model_dir(model)
        cfg = AlignerConfig.load(model_dir)
        with torch.device("meta"):
            module = cls(cfg)
        tensors = read_tensors(safetensors_files(model_dir), "thinker.")
        load_strict(module, tensors, model_dir, device, dtype)
        # a non-persistent buffer is not in the checkpoint: rebuilt on the device
        module.audio_tower.positional_embedding = AudioEncoder(cfg.audio).positional_embedding.to(device)
        return module

    @torch.inference_mode()
    def classify(self, input_ids: list[torch.Tensor], features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per prompt (1-D ids with its clip's audio tokens), the timestamp class at each `<timestamp>` token."""
        device = self.lm_head.weight.device
        audio = [self.audio_tower(f.to(device, self.lm_head.weight.dtype)) for f in features]
        lengths = [len(ids) for ids in input_ids]
        batch, longest = len(input_ids), max(lengths)
        ids = torch.full((batch, longest), 0, dtype=torch.long)
        valid = torch.zeros(batch, longest, dtype=torch.bool)
        for i, row in enumerate(input_ids):
            ids[i, :len(row)], valid[i, :len(row)] = row, True
        ids, valid = ids.to(device), valid.to(device)
        x = self.model.embed_tokens(ids)
        for i, row_audio in enumerate(audio):
            slots = (ids[i] == self.cfg.audio_token_id).nonzero()[:, 0]
            if len(slots) != len(row_audio):
                raise ValueError(f"prompt {i} has {len(slots)} audio tokens for {len(row_audio)} encoder positions")
            x[i, slots] = row_audio.to(x.dtype)
        positions = torch.arange(longest, device=device).expand(batch, longest)
        cache = KVCache(self.cfg.text, batch, longest, device, x.dtype)
        hidden = self.model.run_layers(x, positions, cache, 0, causal_mask(valid, 0, longest))
        stamps = ids == self.cfg.timestamp_token_id
        classes = self.lm_head(hidden[stamps]).argmax(-1).cpu()
        return list(classes.split(stamps.sum(1).tolist()))
