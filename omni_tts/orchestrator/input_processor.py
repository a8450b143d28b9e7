"""The input processor: a SynthesisRequest → the one prepared request the talker stage takes (`AddRequest`):
prepared as engine/talker_input.py prepares every request (on a single-worker executor: the tokenizer is not
re-entrant), its sampling resolved against the server's defaults and the checkpoint's, and (Base) its reference
audio as 24 kHz float32, unless it gave the x-vector instead.

Reference audio is decoded once: a caller that has the samples already (the server decodes and checks clips as it
takes them) passes a 24 kHz float32 array; paths, file bytes, data URIs and (samples, rate) are read here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable

import numpy as np

from omni_tts.config import PipelineConfig
from omni_tts.engine.talker_input import prepare_talker_input
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig, read_generation_config
from omni_tts.models.qwen3_tts.model import reference_audio_24k
from omni_tts.models.qwen3_tts.prompt import AudioInput, PromptBuilder, PromptLimits, RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer
from omni_tts.stages.messages import AddRequest, EmbedVoice


class InputProcessor:
    def __init__(self, model_dir: str, pipeline: PipelineConfig) -> None:
        self.pipeline = pipeline
        self.config = Qwen3TTSConfig.load(model_dir)
        self.generation_config = read_generation_config(model_dir)
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
        talker_input = await self.tokenize(lambda: prepare_talker_input(
            self.prompts, self.generation_config, request, self.pipeline.sampling, text_open))
        ref_audio = None
        if talker_input.speaker_embedding is None and self.config.tts_model_type == "base":
            ref_audio = await self._reference_audio(request.ref_audio)
        return AddRequest(request_id, talker_input.prompt, talker_input.sampling, talker_input.max_tokens,
                          ref_audio=ref_audio, speaker_embedding=_as_bytes(talker_input.speaker_embedding, np.float32),
                          ref_codes=_as_bytes(talker_input.ref_codes, np.int32),
                          initial_codec_chunk_frames=initial_codec_chunk_frames,
                          voice_version=voice_version if ref_audio is not None else None, text_open=text_open,
                          return_codes=return_codes)

    async def tokenize(self, fn: Callable, *args: object):
        """Run `fn` (tokenizer work) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

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


def _as_bytes(values: np.ndarray | None, dtype: type) -> bytes | None:
    """An array as AddRequest carries it (protocol.py gives each field's dtype)."""
    return None if values is None else values.astype(dtype).tobytes()


def load_prompts(model_dir: str, config: Qwen3TTSConfig, pipeline: PipelineConfig) -> PromptBuilder:
    """The checkpoint's prompt builder (tokenizer, speakers, languages) within the talker's limits."""
    talker = pipeline.stages.talker
    return PromptBuilder(config, load_text_tokenizer(model_dir), PromptLimits(talker.max_text_tokens,
                                                                              talker.max_model_len))
