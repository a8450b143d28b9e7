"""serve-ray's replica: one Ray Serve replica owns one AsyncTTS, whose two stage processes are children of
the replica's actor process, on the GPUs Ray assigned it (CUDA_VISIBLE_DEVICES, which the stages inherit: the stage
config's `cuda:0` is the replica's first GPU).

The API process (ray_tts.RayTTS) calls it through a DeploymentHandle: `generate` and `text_session` stream
the request's SpeechChunks back; an error the client is told about (PIPELINE_ERRORS) comes as the stream's last
item, pickled whole, so the API process raises the very exception a local pipeline would (Ray would wrap a raised
one in the replica's traceback). Cancelling the stream in the API process cancels the method here, which closes
the pipeline's iterator, which aborts the request in both stages. Ray's health check calls `check_health`; after
three failures in a row Ray replaces the replica.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
from ray import serve
from ray.actor import ActorHandle

from omni_tts.config import PipelineConfig, set_torch_threads
from omni_tts.config.settings import SupervisionSettings
from omni_tts.models.qwen3_tts.prompt import AudioInput, SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import default_model_dir
from omni_tts.models.qwen3_tts.weights import resolve_model_dir
from omni_tts.stages.messages import StageStats

from .async_tts import AsyncTTS, TextStream
from .types import PIPELINE_ERRORS, PipelineError, RequestError, SpeechChunk, StageDeadError

Item = SpeechChunk | PipelineError | None


class PipelineReplica:
    async def __init__(self, model: str | None, pipeline: PipelineConfig, cpus: int,
                       supervision: SupervisionSettings) -> None:
        """model: `--model` as given (each node resolves it: a repo id downloads into that node's cache); cpus:
        the replica's share of cores, which its CPU stages' threads split (not every core of the node)."""
        set_torch_threads(1)  # this process only routes messages; the cores belong to the stages
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.tts = AsyncTTS(resolve_model_dir(model) if model else default_model_dir(), pipeline,
                               cpus=cpus, supervision=supervision)
        await self.tts.start()

    async def __del__(self) -> None:  # Serve awaits it when it stops the replica
        await self.tts.shutdown()

    def check_health(self) -> None:
        if not self.tts.is_healthy:
            raise RuntimeError(f"the pipeline is not serving: {self.tts.fatal or self.tts.down_reason}")

    async def generate(self, request: SynthesisRequest, options: dict) -> AsyncIterator[Item]:
        async for item in self._items(self.tts.generate(request, **options)):
            yield item

    async def text_session(self, relay: ActorHandle, request: SynthesisRequest, options: dict) -> AsyncIterator[Item]:
        """A request whose text arrives in pieces through `relay` (ray_tts.TextRelay), keyed by its request id.
        The first item is None once it is open (or the error that refused it)."""
        try:
            stream = await self.tts.open_text_stream(request, **options)
        except PIPELINE_ERRORS as e:
            yield e
            return
        feeder = asyncio.create_task(_feed(relay, stream))
        try:
            yield None
            async for item in self._items(stream.chunks):
                yield item
        finally:
            feeder.cancel()
            await stream.aclose()

    async def embed_voice(self, ref_audio: AudioInput, voice_version: str | None,
                          timeout: float) -> np.ndarray | PipelineError:
        """The pipeline's x-vector of a clip, or the error it raised (returned, pickled whole, as `generate`'s)."""
        try:
            return await self.tts.embed_voice(ref_audio, voice_version, timeout)
        except PIPELINE_ERRORS as e:
            return e

    async def stats(self) -> tuple[str, dict[str, StageStats], dict[str, int]]:
        """This replica's id, its stages' figures ({} while they cannot answer) and its pipeline restarts."""
        stats: dict[str, StageStats] = {}
        if self.tts.is_healthy:
            try:
                stats = await self.tts.stats(timeout=2.0)
            except (StageDeadError, TimeoutError):
                pass
        return self.replica_id, stats, dict(self.tts.restarts)

    async def _items(self, chunks: AsyncIterator[SpeechChunk]) -> AsyncIterator[Item]:
        """The chunks, the first naming this replica, then the error that ended them, if one did."""
        first = True
        try:
            async for chunk in chunks:
                if first:
                    chunk.replica, first = self.replica_id, False
                yield chunk
        except PIPELINE_ERRORS as e:
            yield e
        finally:
            await chunks.aclose()  # also when Serve drops this generator at a yield


async def _feed(relay: ActorHandle, stream: TextStream) -> None:
    """The text pieces the API process pushes, into the stream, until it finishes it or goes away."""
    try:
        while True:
            kind, text = await relay.pull.remote(stream.request_id)
            if kind == "text":
                await stream.append(text)
            elif kind == "finish":
                await stream.finish()
                return
            else:  # closed: the API process cancels this session too
                return
    except RequestError:
        pass  # the request failed with it: the audio stream ends with it
