"""What the HTTP server needs of the TTS pipeline: `AsyncTTS` in one process (`omni-tts serve`), or `RayTTS`
(ray_tts.py), which forwards to AsyncTTS replicas under Ray Serve (`omni-tts serve-ray`). The HTTP layer
(`entrypoints/api/`) is written against this alone, so every route answers the same whichever pipeline is behind it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import numpy as np

from omni_tts.config.settings import ApiSettings
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.prompt import AudioInput, PromptBuilder, SynthesisRequest
from omni_tts.stages.messages import StageStats

from .types import SpeechChunk


class SpeechTextStream(Protocol):
    """A request whose text arrives in pieces (async_tts.TextStream): append, finish, iterate for the audio;
    aclose aborts it unless it ended."""

    async def append(self, text: str) -> None: ...

    async def finish(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[SpeechChunk]: ...

    async def aclose(self) -> None: ...


class TTSClient(Protocol):
    @property
    def config(self) -> Qwen3TTSConfig: ...

    @property
    def prompts(self) -> PromptBuilder:
        """The checkpoint's speakers and languages (and its tokenizer)."""

    @property
    def is_healthy(self) -> bool:
        """New requests can be served now."""

    @property
    def down(self) -> str | None:
        """What failed and is being recovered from, while unhealthy."""

    @property
    def down_reason(self) -> str | None: ...

    @property
    def fatal(self) -> str | None:
        """Why the pipeline gave up for good, if it did."""

    @property
    def restarts(self) -> Mapping[str, int]:
        """Pipeline restarts so far, by the stage that failed; never decreases."""

    def is_loaded(self) -> bool:
        """Its model's talker runs now (an idle model's may be unloaded: AsyncTTS's idle_unload)."""

    async def load_model(self) -> float:
        """Returns once its model's talker runs (loading it if it was unloaded): the seconds waited for a load."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request: SynthesisRequest, request_id: str | None = None,
                 initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                 first_audio_timeout: float | None = None, timeout: float | None = None,
                 return_codes: bool = False) -> AsyncIterator[SpeechChunk]:
        """return_codes: the last chunk carries the generated codes (AsyncTTS.generate)."""

    async def open_text_stream(self, request: SynthesisRequest, request_id: str | None = None,
                               initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                               first_audio_timeout: float | None = None, timeout: float | None = None,
                               idle_timeout: float = ApiSettings.stream_idle_timeout) -> SpeechTextStream: ...

    async def embed_voice(self, ref_audio: AudioInput, voice_version: str | None = None,
                          timeout: float = 60.0) -> np.ndarray:
        """The x-vector the talker computes from a clip (float32 [enc_dim]; Base checkpoints): sent back as a
        request's `speaker_embedding`, it gives the clip's x-vector-only audio (AsyncTTS.embed_voice)."""

    async def stats(self, timeout: float = 10.0) -> dict[str, StageStats]:
        """The stages' figures, keyed by stage name (`<replica>/<stage>` when several pipelines answer)."""
