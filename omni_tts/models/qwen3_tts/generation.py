"""Offline generation: prompts → codec frames [T, 16] → audio, by driving the serving engines to completion.

There is one generation loop (each engine's step: schedule → run → postprocess); offline synthesis only feeds it
every request at once and collects the output. Per request: N sampled tokens give at most N − 1 frames; a row
ends at its first EOS or at its token limit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_tts.engine.code2wav_engine import CodecChunk, Code2WavEngine
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest

from .config import Qwen3TTSConfig
from .sampling import ResolvedSampling
from .speech_decoder import SpeechDecoder
from .talker import Talker

# protection against a model that never emits EOS: a token limit of max(floor, per_text_token × text tokens)
TOKEN_CAP_FLOOR = 192
TOKEN_CAP_PER_TEXT_TOKEN = 12


@dataclass
class GeneratedCodes:
    codes: torch.Tensor   # [T, 16] int64 on the CPU
    finish_reason: str    # "stop" (EOS) or "length" (token limit)


def token_limit(max_new_tokens: int, num_text_tokens: int, cap_floor: int | None = TOKEN_CAP_FLOOR,
                cap_per_text_token: int = TOKEN_CAP_PER_TEXT_TOKEN) -> int:
    """min(requested or configured max_new_tokens, max(cap_floor, cap_per_text_token × text tokens));
    cap_floor None disables the cap."""
    if cap_floor is None:
        return max_new_tokens
    return min(max_new_tokens, max(cap_floor, cap_per_text_token * num_text_tokens))


def generate_codes(talker: Talker, config: Qwen3TTSConfig, prefills: list[torch.Tensor],
                   trailings: list[torch.Tensor], params: list[ResolvedSampling],
                   limits: list[int]) -> list[GeneratedCodes]:
    """prefills[i]: [L_i, H]; trailings[i]: [T_i, H]; limits[i]: max sampled tokens. All rows run as one batch."""
    longest = max(p.shape[0] + limit for p, limit in zip(prefills, limits))
    engine = TalkerEngine(talker, config, max_batch_size=len(prefills), max_model_len=max(16, longest + 1),
                          max_prefill_tokens_per_step=sum(p.shape[0] for p in prefills),
                          max_text_tokens=max(t.shape[0] for t in trailings))
    frames: dict[str, list[np.ndarray]] = {}
    reasons: dict[str, str] = {}
    for i, (prefill, trailing, sampling, limit) in enumerate(zip(prefills, trailings, params, limits)):
        engine.add_request(TalkerRequest(str(i), prefill, trailing, sampling, limit))
        frames[str(i)] = []
    while engine.has_work():
        for out in engine.step():
            if out.frame is not None:
                frames[out.request_id].append(out.frame)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [GeneratedCodes(torch.from_numpy(np.array(frames[str(i)], dtype=np.int64).reshape(-1, 16)), reasons[str(i)])
            for i in range(len(prefills))]


def decode_codes(decoder: SpeechDecoder, codes: list[torch.Tensor],
                 contexts: list[torch.Tensor | None]) -> list[np.ndarray]:
    """codes[i]: [T_i, 16] → float32 audio at 24 kHz through the serving `Code2WavEngine`, each request as one whole
    chunk; contexts[i] (ICL reference codes) prime the decoder and are not in the audio. One request per decoder
    call: a batched call differs from a single one in the last bits, and offline a batch must give each request
    exactly what it gives alone."""
    engine = Code2WavEngine(decoder, max_batch_size=1)
    audio: dict[str, list[np.ndarray]] = {}
    for i, (frames, context) in enumerate(zip(codes, contexts)):
        rid = str(i)
        engine.add_request(rid)
        audio[rid] = []
        if context is not None:
            engine.add_chunk(rid, CodecChunk(context.cpu().numpy(), is_context=True))
        engine.add_chunk(rid, CodecChunk(frames.numpy(), is_last=True))
    while engine.has_work():
        for out in engine.step():
            audio[out.request_id].append(out.audio)
    return [np.concatenate(audio[str(i)]).astype(np.float32) for i in range(len(codes))]
