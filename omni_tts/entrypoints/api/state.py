"""What the app's handlers share: the pipeline, the config, the metrics, the uploaded-voice store and the thread pools
that keep blocking work off the event loop."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Callable, Iterator, TypeVar

from aiohttp import web

from omni_tts.audio.url_fetch import RemoteAudioFetcher
from omni_tts.voices.array_lru import ArrayLRU
from omni_tts.entrypoints.api.metrics import ServerMetrics
from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.voices.consents import ConsentStore
from omni_tts.voices.store import VoiceStore, VoiceStoreBackend
from omni_tts.voices.manifest import VoicesWithManifest
from omni_tts.orchestrator.aligner_client import AlignerClient
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.tts_client import TTSClient
from omni_tts.stages.messages import StageStats

from .pronunciation.dictionaries import PronunciationDictionaries
from .served_models import ServedModel, adapter_model, served_models
from .server_config import ServerConfig
from .in_flight import InFlight

T = TypeVar("T")
VOICE_EMBEDDINGS_BYTES = 64 * 2**20   # 8192 x-vectors of the 1.7B checkpoints (2048 float32 each)
MAX_VOICE_WRITES = 8   # uploads and deletes admitted at once (each may hold a clip's body while it waits)


class ServerState:
    """Owns the pools and the fetcher (closed by `close`). `pool` encodes, resamples and base64s for every response:
    nothing in it may wait on anything but the CPU. The voice store's reads (a speech request's voice, a listing)
    run in `voice_pool`, its writes (uploads, deletes), which wait on the replicas' file lock, one at a time in
    `voice_writes`, at most MAX_VOICE_WRITES admitted (`voice_write_slot`): a held lock stalls neither an encoder
    nor a speech request's voice."""

    def __init__(self, tts: TTSClient, config: ServerConfig, in_flight: InFlight) -> None:
        """tts: the whole engine (health, stats); each model's own client is in `models`. ValueError for a
        --default-voice the default model lacks."""
        self.tts, self.config = tts, config
        self.models = served_models(tts, config)
        self.default_model = next(iter(self.models.values()))
        # LoRA adapters served as models (lora_routes.py loads and unloads more), by name
        self.adapters = {name: adapter_model(name, self.models[model])
                         for name, model in (tts.adapters.model_of if isinstance(tts, AsyncTTS) else {}).items()}
        self.voice_names = self.default_model.voice_names
        self.metrics = ServerMetrics()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="omni-tts-audio-io")
        self.voice_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="omni-tts-voices")
        self.voice_writes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tts-voice-writes")
        self.voice_writes_admitted = 0
        # another VoiceStoreBackend (voices/backend.py: an object store) would be built here
        self.voices: VoiceStoreBackend | None = (
            VoiceStore(config.voices_dir, quota_bytes=config.voices_quota_bytes) if config.voices_dir else None)
        if config.voices_manifest is not None:
            self.voices = VoicesWithManifest(config.voices_manifest, self.voices)
        # the consent recordings uploaded voices name, kept beside them
        self.consents = (ConsentStore(config.voices_dir, quota_bytes=config.voices_quota_bytes)
                         if config.voices_dir else None)
        # clip voices' x-vectors by voice version, as GET /v1/audio/voices/{name}/embedding computed them
        self.voice_embeddings = ArrayLRU(VOICE_EMBEDDINGS_BYTES)
        self.fetcher = RemoteAudioFetcher(config.ref_audio_urls) if config.ref_audio_urls else None
        self.admitted = 0
        self.in_flight = in_flight
        self.aligner: AlignerClient | None = None   # word timestamps; None: the server has no forced aligner
        self.pronunciation = PronunciationDictionaries(config.voices_dir, config.pronunciation)

    def served_model(self, model: str | None) -> ServedModel:
        """The model a request's `model` names (names.served_model; absent: the default), or 404 listing the
        served names."""
        if model is None:
            return self.default_model
        if model in self.adapters:
            return self.adapters[model]
        served = self.config.served_model(model)
        if served is None:
            available = ", ".join((*self.config.model_names, *self.adapters))
            raise ApiError(404, f"model '{model}' is not served here; available: {available}, or an alias "
                                "(ElevenLabs', DashScope's and OpenAI Realtime's model names)", "model",
                           "model_not_found")
        return self.models[self.config.model_of(served)]

    @property
    def clone_model(self) -> ServedModel:
        """The model uploaded voices are made with (their x-vectors, their checks): the first Base model (a clip
        voice serves every Base model: they share the speaker encoder's input), else the default."""
        return next(iter(self.models_of_type("base")), self.default_model)

    def models_of_type(self, model_type: str) -> list[ServedModel]:
        """The served models of a kind (custom_voice, voice_design, base), the default first."""
        return [model for model in self.models.values() if model.model_type == model_type]

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the audio pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def run_voices(self, fn: Callable[..., T], *args: object) -> T:
        """A voice-store read `fn(*args)` in the voice pool."""
        return await asyncio.get_running_loop().run_in_executor(self.voice_pool, fn, *args)

    @contextlib.contextmanager
    def voice_write_slot(self) -> Iterator[None]:
        """An upload's or delete's place among MAX_VOICE_WRITES, taken before its body is read: 429 beyond."""
        if self.voice_writes_admitted >= MAX_VOICE_WRITES:
            raise ApiError(429, f"{MAX_VOICE_WRITES} voice uploads or deletes are waiting already; retry shortly")
        self.voice_writes_admitted += 1
        try:
            yield
        finally:
            self.voice_writes_admitted -= 1

    async def write_voices(self, fn: Callable[..., T], *args: object) -> T:
        """A voice-store write `fn(*args)` in the writers' pool (inside a `voice_write_slot`)."""
        return await asyncio.get_running_loop().run_in_executor(self.voice_writes, fn, *args)

    async def stage_stats(self) -> dict[str, StageStats]:
        """The stages' figures, {} if they cannot be had."""
        if not self.tts.is_healthy:
            return {}
        try:
            return await self.tts.stats(timeout=2.0)
        except Exception:
            return {}

    async def close(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.voice_pool.shutdown(wait=False, cancel_futures=True)
        self.voice_writes.shutdown(wait=False, cancel_futures=True)


TTS = web.AppKey("tts", TTSClient)
CONFIG = web.AppKey("config", ServerConfig)
STATE = web.AppKey("state", ServerState)
