"""The input processor: a SynthesisRequest → the one prepared request the talker stage takes (`AddRequest`):
validated and tokenized (a single-worker executor: the tokenizer is not re-entrant), its voice and sampling
resolved against the checkpoint and the server's defaults, and (Base) its reference audio as 24 kHz float32 or
the x-vector it was given instead.

Reference audio is decoded once: a caller that has the samples already (the server decodes and checks clips as it
takes them) passes a 24 kHz float32 array; paths, file bytes, data URIs and (samples, rate) are read here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Callable

import numpy as np

from omni_tts.config import PipelineConfig
from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig, read_json
from omni_tts.models.qwen3_tts.model import reference_audio_24k
from omni_tts.models.qwen3_tts.prompt import AudioInput, PromptBuilder, PromptLimits, RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling_params import ResolvedSampling, SamplingError, SamplingParams, resolve_sampling
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer
from omni_tts.stages.messages import AddRequest, EmbedVoice


class InputProcessor:
    def __init__(self, model_dir: str, pipeline: PipelineConfig) -> None:
        self.pipeline = pipeline
        self.config = Qwen3TTSConfig.load(model_dir)
        gen_path = os.path.join(model_dir, "generation_config.json")
        self.generation_config = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self.prompts = load_prompts(model_dir, self.config, pipeline)
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tts-tokenizer")
        self.audio_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="omni-tts-audio")

    async def process(self, request_id: str, request: SynthesisRequest, text_open: bool,
                      initial_codec_chunk_frames: int | None, voice_version: str | None,
                      return_codes: bool = False) -> AddRequest:
        """The request for the talker; RequestError for bad input. text_open: its text arrives later, in pieces
        (the prompt has no text ids yet; see AsyncTTS.open_text_stream). return_codes: its TalkerDone carries the
        generated codes."""
        if initial_codec_chunk_frames is not None:
            try:
                self.pipeline.connector.check_chunk_frames("initial_codec_chunk_frames", initial_codec_chunk_frames)
            except ValueError as e:
                raise RequestError("initial_codec_chunk_frames", str(e)) from None
        prompt = await self.tokenize(self.prompts.tokenize, request, text_open)
        sampling = self.resolve_sampling(request.sampling)
        ref_audio = embedding = ref_codes = None
        if request.ref_codes is not None:  # checked by tokenize: integers within the codebook
            ref_codes = np.asarray(request.ref_codes, dtype=np.int32).tobytes()
        if request.speaker_embedding is not None:  # checked by tokenize: a Base checkpoint's x-vector
            embedding = np.asarray(request.speaker_embedding, dtype=np.float32).tobytes()
        elif self.config.tts_model_type == "base":
            ref_audio = await self._reference_audio(request.ref_audio)
        return AddRequest(request_id, prompt, sampling, token_limit(sampling.max_new_tokens, len(prompt.text_ids)),
                          ref_audio=ref_audio, speaker_embedding=embedding, ref_codes=ref_codes,
                          initial_codec_chunk_frames=initial_codec_chunk_frames,
                          voice_version=voice_version if ref_audio is not None else None, text_open=text_open,
                          return_codes=return_codes)

    async def tokenize(self, fn: Callable, *args: object):
        """Run `fn` (tokenizer work) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def resolve_sampling(self, params: SamplingParams) -> ResolvedSampling:
        """The request's sampling over the server's defaults over the checkpoint's generation config."""
        try:
            return resolve_sampling(params, self.generation_config, self.pipeline.sampling)
        except SamplingError as e:
            raise RequestError(e.param, str(e)) from None

    async def embed_voice(self, request_id: str, ref_audio: AudioInput, voice_version: str | None) -> EmbedVoice:
        """The talker's question for a clip's x-vector (Base checkpoints; RequestError('ref_audio') otherwise)."""
        if self.config.tts_model_type != "base":
            raise RequestError("ref_audio", "speaker embeddings need a Base (voice clone) model")
        return EmbedVoice(request_id, await self._reference_audio(ref_audio), voice_version)

    async def _reference_audio(self, ref_audio: AudioInput | None) -> bytes:
        if isinstance(ref_audio, np.ndarray):  # decoded by the caller: checked here, not read again
            wav = reference_audio_24k(ref_audio)
        else:
            wav = await asyncio.get_running_loop().run_in_executor(self.audio_pool, reference_audio_24k, ref_audio)
        return wav.astype(np.float32, copy=False).tobytes()

    def close(self) -> None:
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.audio_pool.shutdown(wait=False, cancel_futures=True)


def load_prompts(model_dir: str, config: Qwen3TTSConfig, pipeline: PipelineConfig) -> PromptBuilder:
    """The checkpoint's prompt builder (tokenizer, speakers, languages) within the talker's limits."""
    talker = pipeline.stages.talker
    return PromptBuilder(config, load_text_tokenizer(model_dir), PromptLimits(talker.max_text_tokens,
                                                                              talker.max_model_len))
