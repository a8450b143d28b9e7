"""One model of a server of several: the TTSClient the HTTP layer uses for a request that named
it, its checkpoint's config and prompts, every request sent as that model's."""
from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from omni_tts.config.settings import ApiSettings
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.prompt import AudioInput, PromptBuilder, SynthesisRequest

from .async_tts import AsyncTTS, TextStream
from .types import SpeechChunk


class ModelClient:
    def __init__(self, engine: AsyncTTS, name: str, lora: str | None = None) -> None:
        """name: one of the engine's models (KeyError otherwise); lora: one of its adapters, every request's."""
        self.engine, self.name, self.processor, self.lora = engine, name, engine.processors[name], lora

    @property
    def config(self) -> Qwen3TTSConfig:
        return self.processor.config

    @property
    def prompts(self) -> PromptBuilder:
        return self.processor.prompts

    def __getattr__(self, name: str) -> object:
        """What is the pipeline's, not the model's (health, restarts, stats, start and shutdown): the engine's."""
        return getattr(self.engine, name)

    def is_loaded(self) -> bool:
        """Its talker runs now (an idle model's may be unloaded)."""
        return self.engine.is_loaded(self.name)

    async def load_model(self) -> float:
        """Returns once its talker runs: the seconds waited for a load (0.0 when it ran)."""
        return await self.engine.load_model(self.name)

    def generate(self, request: SynthesisRequest, request_id: str | None = None,
                 initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                 first_audio_timeout: float | None = None, timeout: float | None = None,
                 return_codes: bool = False) -> AsyncIterator[SpeechChunk]:
        return self.engine.generate(request, request_id, initial_codec_chunk_frames, voice_version,
                                    first_audio_timeout, timeout, return_codes, model=self.name, lora=self.lora)

    async def open_text_stream(self, request: SynthesisRequest, request_id: str | None = None,
                               initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                               first_audio_timeout: float | None = None, timeout: float | None = None,
                               idle_timeout: float = ApiSettings.stream_idle_timeout) -> TextStream:
        return await self.engine.open_text_stream(request, request_id, initial_codec_chunk_frames, voice_version,
                                                  first_audio_timeout, timeout, idle_timeout, model=self.name,
                                                  lora=self.lora)

    async def embed_voice(self, ref_audio: AudioInput, voice_version: str | None = None,
                          timeout: float = 60.0) -> np.ndarray:
        return await self.engine.embed_voice(ref_audio, voice_version, timeout, model=self.name)
