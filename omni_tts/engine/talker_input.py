"""A SynthesisRequest → the talker's input, prepared one way for offline synthesis (offline.py), the server's input
processor (orchestrator/input_processor.py) and the talker stage (stages/talker_stage.py).

`prepare_talker_input` applies the request's pronunciation aliases to its text (models/qwen3_tts/lexicon.py), tokenizes
and checks the request, resolves its sampling and its token limit, and keeps the voice it gives as data (ICL reference
codes, an x-vector); where the talker runs, `give_voice` puts that voice into
the prompt, and what is left of a Base voice comes from its clip (Qwen3TTS.add_voice_features: in the server, on
the talker stage's voice-feature worker). Then embed_prompt makes the talker's rows.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_tts.models.qwen3_tts.prompt import PromptBuilder, RequestError, SynthesisRequest, TalkerPrompt
from omni_tts.models.qwen3_tts.sampling_params import (ResolvedSampling, SamplingDefaults, SamplingError,
                                                      resolve_sampling)

from .token_limit import TOKEN_CAP_FLOOR, token_limit


@dataclass
class TalkerInput:
    prompt: TalkerPrompt                   # tokenized and checked; no voice features yet
    sampling: ResolvedSampling
    max_tokens: int                        # its token limit (with text still to come: for the text so far)
    ref_codes: np.ndarray | None           # ICL reference codes given as codes, int64 [T, num_code_groups]
    speaker_embedding: np.ndarray | None   # the x-vector given instead of a clip, float32 [enc_dim]


def prepare_talker_input(prompts: PromptBuilder, generation_config: dict[str, Any], request: SynthesisRequest,
                         sampling_defaults: SamplingDefaults | None = None, text_open: bool = False,
                         token_cap_floor: int | None = TOKEN_CAP_FLOOR) -> TalkerInput:
    """RequestError names the offending field. sampling_defaults: the server's, over the checkpoint's
    generation_config; text_open: the text arrives later, in pieces (the prompt has no text ids yet);
    token_cap_floor None: no cap on the token limit by the text's length (`token_limit`)."""
    if request.lexicon is not None and not text_open:  # a text in pieces meets its lexicon in AsyncTTS's TextStream
        request = dataclasses.replace(request, text=request.lexicon.apply(request.text))
    prompt = prompts.tokenize(request, text_open)   # checks ref_codes and speaker_embedding too
    try:
        sampling = resolve_sampling(request.sampling, generation_config, sampling_defaults)
    except SamplingError as e:
        raise RequestError(e.param, str(e)) from None
    ref_codes = None if request.ref_codes is None else np.asarray(request.ref_codes, dtype=np.int64)
    embedding = (None if request.speaker_embedding is None else
                 np.asarray(request.speaker_embedding, dtype=np.float32))
    return TalkerInput(prompt, sampling, token_limit(sampling.max_new_tokens, len(prompt.text_ids), token_cap_floor),
                       ref_codes, embedding)


def give_voice(prompt: TalkerPrompt, ref_codes: np.ndarray | None, speaker_embedding: np.ndarray | None) -> bool:
    """Put the voice a request gave as data into its prompt (on the CPU: embed_prompt moves it to the talker's
    device). True when the voice needs no clip (its x-vector is given)."""
    if ref_codes is not None:
        prompt.ref_codes = torch.from_numpy(ref_codes.astype(np.int64))
    if speaker_embedding is not None:
        prompt.speaker_embedding = torch.from_numpy(speaker_embedding.astype(np.float32))
    return speaker_embedding is not None
