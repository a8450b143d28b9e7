"""Word timestamps for (audio, text) pairs: words → prompt → one classifier forward → monotonic times.

`ForcedAligner.align` is the whole reference pipeline (`Qwen3ForcedAligner.align` of qwen-asr): the text's words
(`words.split_words`), the prompt `<|audio_start|>` + one `<|audio_pad|>` per encoder position + `<|audio_end|>`,
then each word followed by two `<timestamp>` tokens (its start and end), the classes read at those tokens, times
in ms made monotonic by `words.fix_timestamp`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..qwen3_tts.text_tokenizer import load_text_tokenizer
from ..qwen3_tts.weights import resolve_model_dir
from .encoder import encoder_length
from .features import N_FFT, log_mel, num_frames, to_16k
from .model import ForcedAlignerModel
from .words import fix_timestamp, split_words

# the STFT pads a clip by reflection, which needs more than n_fft / 2 samples; shorter clips have no words' worth
MIN_SAMPLES_16K = N_FFT // 2 + 1


@dataclass(frozen=True)
class WordTime:
    word: str
    start_ms: int
    end_ms: int


@dataclass(frozen=True)
class AlignItem:
    audio: np.ndarray     # mono float samples
    sample_rate: int
    text: str
    language: str | None = None


class ForcedAligner:
    def __init__(self, model: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        model_dir = resolve_model_dir(model)
        self.model = ForcedAlignerModel.load(model_dir, device, dtype)
        self.cfg = self.model.cfg
        self.tokenizer = load_text_tokenizer(model_dir)

    def prompt_ids(self, words: list[str], audio_tokens: int) -> list[int]:
        cfg = self.cfg
        ids = [cfg.audio_start_token_id] + [cfg.audio_token_id] * audio_tokens + [cfg.audio_end_token_id]
        for word in words:
            ids += self.tokenizer.encode(word, add_special_tokens=False).ids
            ids += [cfg.timestamp_token_id] * 2
        return ids

    def align(self, items: list[AlignItem]) -> list[list[WordTime]]:
        """One batch: per item its words with start/end in ms, in text order (no words: an empty list)."""
        results: list[list[WordTime]] = [[] for _ in items]
        prompts, features, owners, word_lists = [], [], [], []
        for i, item in enumerate(items):
            words = split_words(item.text, item.language)
            audio = to_16k(item.audio, item.sample_rate)
            if not words or audio.shape[0] < MIN_SAMPLES_16K:
                continue
            feats = log_mel(audio, self.cfg.audio.num_mel_bins)
            tokens = encoder_length(num_frames(audio.shape[0]), self.model.audio_tower.chunk_frames)
            prompts.append(torch.tensor(self.prompt_ids(words, tokens)))
            features.append(feats)
            owners.append(i)
            word_lists.append(words)
        if not prompts:
            return results
        for i, words, classes in zip(owners, word_lists, self.model.classify(prompts, features)):
            ms = fix_timestamp((classes.double() * self.cfg.timestamp_ms).tolist())
            results[i] = [WordTime(w, ms[2 * k], ms[2 * k + 1]) for k, w in enumerate(words)]
        return results
