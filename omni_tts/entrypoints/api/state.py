"""What the app's handlers share: the pipeline, the config, the metrics, the uploaded-voice store and the thread pools
that keep blocking work off the event loop."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable, TypeVar

from aiohttp import web

from omni_tts.audio.url_fetch import RemoteAudioFetcher
from omni_tts.voices.array_lru import ArrayLRU
from omni_tts.entrypoints.api.metrics import ServerMetrics
from omni_tts.entrypoints.api.names import VoiceNames
from omni_tts.voices.store import VoiceStore, VoiceStoreBackend
from omni_tts.voices.manifest import VoicesWithManifest
from omni_tts.orchestrator.aligner_client import AlignerClient
from omni_tts.orchestrator.tts_client import TTSClient
from omni_tts.stages.messages import StageStats

from .server_config import ServerConfig
from .in_flight import InFlight

T = TypeVar("T")
VOICE_EMBEDDINGS_BYTES = 64 * 2**20   # 8192 x-vectors of the 1.7B checkpoints (2048 float32 each)


class ServerState:
    """Owns the pools and the fetcher (closed by `close`). `pool` encodes, resamples and base64s for every response:
    nothing in it may wait on anything but the CPU. The voice store's calls, which may wait on the replicas' file
    lock, run in `voice_pool` instead, so a held lock never stalls an encoder."""

    def __init__(self, tts: TTSClient, config: ServerConfig, voice_names: VoiceNames, in_flight: InFlight) -> None:
        self.tts, self.config, self.voice_names = tts, config, voice_names
        self.metrics = ServerMetrics()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="omni-tts-audio-io")
        self.voice_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="omni-tts-voices")
        # another VoiceStoreBackend (voices/backend.py: an object store) would be built here
        self.voices: VoiceStoreBackend | None = (
            VoiceStore(config.voices_dir, quota_bytes=config.voices_quota_bytes) if config.voices_dir else None)
        if config.voices_manifest is not None:
            self.voices = VoicesWithManifest(config.voices_manifest, self.voices)
        # clip voices' x-vectors by voice version, as GET /v1/audio/voices/{name}/embedding computed them
        self.voice_embeddings = ArrayLRU(VOICE_EMBEDDINGS_BYTES)
        self.fetcher = RemoteAudioFetcher(config.ref_audio_urls) if config.ref_audio_urls else None
        self.admitted = 0
        self.in_flight = in_flight
        self.aligner: AlignerClient | None = None   # word timestamps; None: the server has no forced aligner

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the audio pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def run_voices(self, fn: Callable[..., T], *args: object) -> T:
        """A voice-store call `fn(*args)` in the voice pool."""
        return await asyncio.get_running_loop().run_in_executor(self.voice_pool, fn, *args)

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


TTS = web.AppKey("tts", TTSClient)
CONFIG = web.AppKey("config", ServerConfig)
STATE = web.AppKey("state", ServerState)
