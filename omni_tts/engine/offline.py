"""Offline synthesis: requests → codec frames [T, 16] → audio, by driving the serving engines to completion.

    tts = Qwen3TTS.from_pretrained("path/or/owner-name", device="cpu", dtype=torch.float32)
    results = synthesize(tts, [SynthesisRequest(text="Hello.", voice="ryan",
                                                sampling=SamplingParams(temperature=0))])
    results[0].codes  # [T, 16] int64,  results[0].audio  # float32, 24 kHz

There is one generation loop (each engine's step: schedule → run → postprocess); offline synthesis only feeds it
every request at once and collects the output. Per request: N sampled tokens give at most N − 1 frames; a row
ends at its first EOS or at its token limit. A request may run with a LoRA adapter (`loras[i]`, read by
`lora.read_adapter`): rows with different adapters, and none, run in one batch as they do when served.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.lora import LoRAAdapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest, TalkerPrompt, embed_prompt
from omni_tts.models.qwen3_tts.sampling_params import ResolvedSampling
from omni_tts.models.qwen3_tts.speech_decoder import SpeechDecoder
from omni_tts.models.qwen3_tts.talker import Talker

from .code2wav_engine import CodecChunk, Code2WavEngine
from .talker_engine import TalkerEngine, TalkerRequest
from .talker_input import give_voice, prepare_talker_input
from .token_limit import TOKEN_CAP_FLOOR


@dataclass
class PreparedRequest:
    """A request ready for the talker: prefill rows, trailing rows, resolved sampling and its token limit."""
    prompt: TalkerPrompt
    prefill: torch.Tensor     # [L, H]
    trailing: torch.Tensor    # [T, H]
    sampling: ResolvedSampling
    max_tokens: int


@dataclass
class GeneratedCodes:
    codes: torch.Tensor   # [T, 16] int64 on the CPU
    finish_reason: str    # "stop" (EOS) or "length" (token limit)


@dataclass
class SynthesisResult:
    codes: np.ndarray         # [T, 16] int64, codebook 0 first
    audio: np.ndarray         # [samples] float32 at 24 kHz
    finish_reason: str        # "stop" (EOS) or "length" (token limit reached; the audio so far is delivered)
    num_prompt_rows: int      # prefill length in talker positions
    num_text_tokens: int
    sample_rate: int = SAMPLE_RATE


def prepare(tts: Qwen3TTS, request: SynthesisRequest, token_cap_floor: int | None = TOKEN_CAP_FLOOR
            ) -> PreparedRequest:
    """The request as the talker stage would take it (talker_input.py), its Base voice features and its rows:
    RequestError names the offending field. token_cap_floor None disables the text-length cap on the token limit
    (`token_limit`)."""
    talker_input = prepare_talker_input(tts.prompts, tts.generation_config, request, token_cap_floor=token_cap_floor)
    prompt = talker_input.prompt
    if not give_voice(prompt, talker_input.ref_codes, talker_input.speaker_embedding):
        tts.add_voice_features(prompt, request.ref_audio)
    prefill, trailing = embed_prompt(tts.talker, tts.config, prompt)
    return PreparedRequest(prompt, prefill, trailing, talker_input.sampling, talker_input.max_tokens)


@torch.no_grad()
def synthesize(tts: Qwen3TTS, requests: list[SynthesisRequest], token_cap_floor: int | None = TOKEN_CAP_FLOOR,
               loras: Sequence[LoRAAdapter | None] | None = None) -> list[SynthesisResult]:
    """Generate a batch of requests together; each result equals what the request gives alone. loras[i]: the
    adapter request i runs with (None: the base model)."""
    prepared = [prepare(tts, r, token_cap_floor) for r in requests]
    generated = generate_codes(tts.talker, tts.config, [p.prefill for p in prepared], [p.trailing for p in prepared],
                               [p.sampling for p in prepared], [p.max_tokens for p in prepared], loras)
    audios = decode_codes(tts.decoder, [g.codes for g in generated], [p.prompt.ref_codes for p in prepared])
    return [SynthesisResult(codes=g.codes.numpy(), audio=audio, finish_reason=g.finish_reason,
                            num_prompt_rows=p.prefill.shape[0], num_text_tokens=len(p.prompt.text_ids))
            for p, g, audio in zip(prepared, generated, audios)]


def generate_codes(talker: Talker, config: Qwen3TTSConfig, prefills: list[torch.Tensor],
                   trailings: list[torch.Tensor], params: list[ResolvedSampling], limits: list[int],
                   loras: Sequence[LoRAAdapter | None] | None = None,
                   static_shapes: bool = False) -> list[GeneratedCodes]:
    """prefills[i]: [L_i, H]; trailings[i]: [T_i, H]; limits[i]: max sampled tokens; loras[i]: row i's adapter.
    All rows run as one batch; static_shapes: the engine's (what the server's graphs replay; the same codes)."""
    longest = max(p.shape[0] + limit for p, limit in zip(prefills, limits))
    loras = list(loras or [None] * len(prefills))
    adapters = {id(a): a for a in loras if a is not None}   # each distinct adapter in one slot
    engine = TalkerEngine(talker, config, max_batch_size=len(prefills), max_model_len=max(16, longest + 1),
                          max_prefill_tokens_per_step=sum(p.shape[0] for p in prefills),
                          max_text_tokens=max(t.shape[0] for t in trailings), max_loras=len(adapters),
                          max_lora_rank=max((a.rank for a in adapters.values()), default=1),
                          static_shapes=static_shapes)
    for key, adapter in adapters.items():
        engine.load_lora(str(key), adapter)
    frames: dict[str, list[np.ndarray]] = {}
    reasons: dict[str, str] = {}
    for i, (prefill, trailing, sampling, limit, lora) in enumerate(zip(prefills, trailings, params, limits, loras)):
        engine.add_request(TalkerRequest(str(i), prefill, trailing, sampling, limit,
                                         lora=None if lora is None else str(id(lora))))
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
