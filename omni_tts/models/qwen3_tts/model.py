"""A loaded Qwen3-TTS-12Hz checkpoint and the offline (batched) synthesis API.

    tts = Qwen3TTS.from_pretrained("path/or/owner-name", device="cpu", dtype=torch.float32)
    results = tts.synthesize([SynthesisRequest(text="Hello.", voice="ryan", sampling=SamplingParams(temperature=0))])
    results[0].codes  # [T, 16] int64,  results[0].audio  # float32, 24 kHz
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .audio import TARGET_SAMPLE_RATE, load_audio, resample_to
from .config import Qwen3TTSConfig, SpeechTokenizerConfig, read_json
from .generation import TOKEN_CAP_FLOOR, decode_codes, generate_codes, token_limit
from .prompt import AudioInput, PromptBuilder, RequestError, SynthesisRequest, TalkerPrompt, embed_prompt
from .sampling import ResolvedSampling, resolve_sampling
from .speaker_encoder import SpeakerEncoder, extract_speaker_embedding
from .speech_decoder import SpeechDecoder
from .speech_encoder import MimiEncoderConfig, SpeechEncoder
from .talker import Talker
from .text_tokenizer import load_text_tokenizer
from .weights import load_strict, read_tensors, resolve_model_dir, safetensors_files

SAMPLE_RATE = TARGET_SAMPLE_RATE


@dataclass
class SynthesisResult:
    codes: np.ndarray         # [T, 16] int64, codebook 0 first
    audio: np.ndarray         # [samples] float32 at 24 kHz
    finish_reason: str        # "stop" (EOS) or "length" (token limit reached; the audio so far is delivered)
    num_prompt_rows: int      # prefill length in talker positions
    num_text_tokens: int
    sample_rate: int = SAMPLE_RATE


@dataclass
class PreparedRequest:
    """A request ready for the talker: prefill rows, trailing rows, resolved sampling and its token limit."""
    prompt: TalkerPrompt
    prefill: torch.Tensor     # [L, H]
    trailing: torch.Tensor    # [T, H]
    sampling: ResolvedSampling
    max_tokens: int


def reference_audio_24k(ref_audio: AudioInput) -> np.ndarray:
    """A path, file bytes, (samples, rate) or samples at 24 kHz → float32 mono at 24 kHz; RequestError('ref_audio')
    if unreadable."""
    try:
        if isinstance(ref_audio, np.ndarray):
            wav, sr = ref_audio, SAMPLE_RATE
        else:
            wav, sr = ref_audio if isinstance(ref_audio, tuple) else load_audio(ref_audio)
        return resample_to(np.asarray(wav, dtype=np.float32), sr, SAMPLE_RATE)
    except (ValueError, OSError, RuntimeError) as e:
        raise RequestError("ref_audio", f"could not read ref_audio: {e}") from None


class Qwen3TTSWeights(nn.Module):
    """`model.safetensors`: `talker.*` (+ `speaker_encoder.*` for Base)."""

    def __init__(self, config: Qwen3TTSConfig) -> None:
        super().__init__()
        self.talker = Talker(config.talker)
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder) if config.speaker_encoder else None


class SpeechTokenizerWeights(nn.Module):
    """`speech_tokenizer/model.safetensors`: `decoder.*` and `encoder.*` (the encoder serves Base voice cloning)."""

    def __init__(self, config: SpeechTokenizerConfig, with_encoder: bool, with_decoder: bool = True) -> None:
        super().__init__()
        self.decoder = SpeechDecoder(config.decoder) if with_decoder else None
        self.encoder = (SpeechEncoder(MimiEncoderConfig.from_dict(config.encoder, config.path),
                                      config.encoder_valid_num_quantizers) if with_encoder else None)


class Qwen3TTS:
    def __init__(self, model_dir: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 token_cap_floor: int | None = TOKEN_CAP_FLOOR, with_talker: bool = True,
                 with_decoder: bool = True) -> None:
        """with_talker / with_decoder: load only one side (the talker stage has no use for the decoder, the
        code2wav stage none for the talker)."""
        self.model_dir = model_dir
        self.device, self.dtype = torch.device(device), dtype
        self.token_cap_floor = token_cap_floor
        self.config = Qwen3TTSConfig.load(model_dir)
        self.speech_config = SpeechTokenizerConfig.load(model_dir)
        gen_path = os.path.join(model_dir, "generation_config.json")
        self.generation_config: dict[str, Any] = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self.prompts = PromptBuilder(self.config, load_text_tokenizer(model_dir))

        is_base = self.config.tts_model_type == "base"
        self.talker: Talker | None = None
        self.speaker_encoder: SpeakerEncoder | None = None
        if with_talker:
            with torch.device("meta"):
                weights = Qwen3TTSWeights(self.config)
            load_strict(weights, read_tensors(safetensors_files(model_dir), ""),
                        os.path.join(model_dir, "model.safetensors"), self.device, dtype)
            self.talker, self.speaker_encoder = weights.talker, weights.speaker_encoder
        # the talker side needs the speech encoder (Base reference audio → codes); code2wav needs the decoder
        with_encoder = with_talker and is_base
        with torch.device("meta"):
            speech = SpeechTokenizerWeights(self.speech_config, with_encoder=with_encoder, with_decoder=with_decoder)
        st_dir = os.path.join(model_dir, "speech_tokenizer")
        wanted = (("encoder.",) if with_encoder else ()) + (("decoder.",) if with_decoder else ())
        st_tensors = {k: v for k, v in read_tensors(safetensors_files(st_dir), "").items() if k.startswith(wanted)}
        load_strict(speech, st_tensors, os.path.join(st_dir, "model.safetensors"), self.device, dtype)
        if speech.encoder is not None:
            speech.encoder.quantizer.float()  # nearest-codebook search stays fp32, as in the reference
        self.decoder: SpeechDecoder | None = speech.decoder
        self.speech_encoder: SpeechEncoder | None = speech.encoder

    @classmethod
    def from_pretrained(cls, model: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        **kwargs: Any) -> "Qwen3TTS":
        return cls(resolve_model_dir(model), device=device, dtype=dtype, **kwargs)

    @property
    def model_type(self) -> str:
        return self.config.tts_model_type

    # --- request preparation -------------------------------------------------------------------------------
    def tokenize(self, request: SynthesisRequest) -> TalkerPrompt:
        return self.prompts.tokenize(request)

    @torch.no_grad()
    def add_voice_features(self, prompt: TalkerPrompt, ref_audio: AudioInput | None) -> None:
        """Base: x-vector (and, for ICL, the reference codes) from the reference audio."""
        if self.model_type != "base":
            return
        wav = reference_audio_24k(ref_audio)
        prompt.speaker_embedding = extract_speaker_embedding(self.speaker_encoder, wav)
        if prompt.ref_text_ids is not None:
            prompt.ref_codes = self.speech_encoder.encode(wav)

    def prepare(self, request: SynthesisRequest) -> PreparedRequest:
        prompt = self.tokenize(request)
        try:
            sampling = resolve_sampling(request.sampling, self.generation_config)
        except ValueError as e:
            raise RequestError(str(e).split(" ", 1)[0], str(e)) from None
        self.add_voice_features(prompt, request.ref_audio)
        prefill, trailing = embed_prompt(self.talker, self.config, prompt)
        limit = token_limit(sampling.max_new_tokens, len(prompt.text_ids), self.token_cap_floor)
        return PreparedRequest(prompt, prefill, trailing, sampling, limit)

    # --- offline synthesis ---------------------------------------------------------------------------------
    @torch.no_grad()
    def synthesize(self, requests: list[SynthesisRequest]) -> list[SynthesisResult]:
        """Generate a batch of requests together; each result equals what the request gives alone."""
        prepared = [self.prepare(r) for r in requests]
        generated = generate_codes(self.talker, self.config, [p.prefill for p in prepared],
                                   [p.trailing for p in prepared], [p.sampling for p in prepared],
                                   [p.max_tokens for p in prepared])
        audios = decode_codes(self.decoder, [g.codes for g in generated], [p.prompt.ref_codes for p in prepared])
        results = []
        for p, g, audio in zip(prepared, generated, audios):
            results.append(SynthesisResult(codes=g.codes.numpy(), audio=audio, finish_reason=g.finish_reason,
                                           num_prompt_rows=p.prefill.shape[0], num_text_tokens=len(p.prompt.text_ids)))
        return results
