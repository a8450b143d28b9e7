"""The pipeline client of `omni-tts serve-ray`'s API process: the TTSClient protocol (tts_client.py) over a Ray Serve
deployment of PipelineReplica (ray_replica.py), so the HTTP layer (`entrypoints/api/`) serves every route as it does
over a local pipeline.

Routing: each request is one call on the DeploymentHandle, which Serve's default router sends to the less loaded of
two random replicas (power of two choices on their ongoing requests; with two replicas, the one with fewer).
A text stream (WS /v1/audio/speech/stream, token mode) is one streaming call, so the whole utterance runs on the
replica the router chose for it; its text pieces, pushed while that call runs, go through one TextRelay actor on
this node, from which the replica pulls them in order (Serve cannot address a call to a chosen replica, and the
relay needs no port of its own). Health: a poll of Serve's status; the API is up while one replica runs.
"""
from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import AsyncIterator, Callable, Mapping

import numpy as np
import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from omni_tts.config import PipelineConfig
from omni_tts.config.settings import ApiSettings
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.prompt import AudioInput, SynthesisRequest
from omni_tts.stages.messages import StageStats

from .input_processor import load_prompts
from .types import SpeechChunk, StageDeadError

STATUS_POLL_SECONDS = 1.0


class TextRelay:
    """Text pieces from the API process to the replica running their stream: one queue per stream, pushed in order
    (each push is awaited before the next) and pulled in order by one puller."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[tuple[str, str]]] = {}

    def open(self, session: str) -> None:
        self._queues[session] = asyncio.Queue()

    def push(self, session: str, kind: str, text: str = "") -> None:
        """kind: text (a piece), finish (the text ended) or closed (the session went away; the queue goes)."""
        queue = self._queues.pop(session, None) if kind == "closed" else self._queues.get(session)
        if queue is not None:
            queue.put_nowait((kind, text))

    async def pull(self, session: str) -> tuple[str, str]:
        queue = self._queues.get(session)
        return await queue.get() if queue is not None else ("closed", "")


class RayTTS:
    def __init__(self, app: serve.Application, app_name: str, deployment: str, model_dir: str,
                 pipeline: PipelineConfig) -> None:
        """app: the bound PipelineReplica deployment, run as `app_name` by start()."""
        self.app, self.app_name, self.deployment = app, app_name, deployment
        self.config = Qwen3TTSConfig.load(model_dir)
        self.prompts = load_prompts(model_dir, self.config, pipeline)
        self.down: str | None = None
        self.down_reason: str | None = None
        self.fatal: str | None = None   # Ray replaces a failed replica: the front end never gives up
        self._replica_restarts: dict[str, Mapping[str, int]] = {}   # each replica's last report, gone ones too
        self._handle: DeploymentHandle | None = None
        self._relay: ray.actor.ActorHandle | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        """Deploy the replicas (returns once they all run), the relay, and the status poll. StageDeadError when
        the replicas do not start."""
        loop = asyncio.get_running_loop()
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._relay = ray.remote(num_cpus=0)(TextRelay).options(scheduling_strategy=here).remote()
        try:
            self._handle = await loop.run_in_executor(None, lambda: serve.run(self.app, name=self.app_name,
                                                                              route_prefix=None))
        except RuntimeError as e:
            raise StageDeadError(f"the replicas did not start: {e}") from None
        await self._poll_status()
        self._watch = asyncio.create_task(self._watch_status())

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._handle is not None:
            await asyncio.get_running_loop().run_in_executor(None, serve.delete, self.app_name)
        if self._relay is not None:
            ray.kill(self._relay)

    @property
    def is_healthy(self) -> bool:
        return self._handle is not None and self.down is None

    @property
    def restarts(self) -> Mapping[str, int]:
        total: collections.Counter[str] = collections.Counter()
        for restarts in self._replica_restarts.values():
            total.update(restarts)
        return total

    async def _watch_status(self) -> None:
        while True:
            await asyncio.sleep(STATUS_POLL_SECONDS)
            try:
                await self._poll_status()
            except Exception as e:  # noqa: BLE001 — an unreachable controller reads as down, and is polled again
                self.down, self.down_reason = "replica", f"Ray Serve's status cannot be read: {e}"

    async def _poll_status(self) -> None:
        status = await asyncio.get_running_loop().run_in_executor(None, serve.status)
        app = status.applications.get(self.app_name)
        deployment = app.deployments.get(self.deployment) if app is not None else None
        states = dict(deployment.replica_states) if deployment is not None else {}
        if states.get("RUNNING", 0) > 0:
            self.down = self.down_reason = None
        else:
            self.down = "replica"
            self.down_reason = "no replica is running" + (
                f" ({', '.join(f'{n} {state.lower()}' for state, n in states.items())})" if states else "")

    def generate(self, request: SynthesisRequest, request_id: str | None = None,
                 initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                 first_audio_timeout: float | None = None, timeout: float | None = None,
                 return_codes: bool = False) -> AsyncIterator[SpeechChunk]:
        options = dict(request_id=request_id, initial_codec_chunk_frames=initial_codec_chunk_frames,
                       voice_version=voice_version, first_audio_timeout=first_audio_timeout, timeout=timeout,
                       return_codes=return_codes)
        return _chunks(lambda: self._handle.options(stream=True).generate.remote(request, options))

    async def open_text_stream(self, request: SynthesisRequest, request_id: str | None = None,
                               initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                               first_audio_timeout: float | None = None, timeout: float | None = None,
                               idle_timeout: float = ApiSettings.stream_idle_timeout) -> "RayTextStream":
        session = request_id or uuid.uuid4().hex
        options = dict(request_id=session, initial_codec_chunk_frames=initial_codec_chunk_frames,
                       voice_version=voice_version, first_audio_timeout=first_audio_timeout, timeout=timeout,
                       idle_timeout=idle_timeout)
        await self._relay.open.remote(session)
        stream = RayTextStream(self._relay, session, _chunks(
            lambda: self._handle.options(stream=True).text_session.remote(self._relay, request, options)))
        try:
            await anext(stream.chunks)  # None once it is open, or the error that refused it
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def is_loaded(self) -> bool:
        return True   # a replica's model stays loaded (no idle unload under Ray Serve)

    async def load_model(self) -> float:
        return 0.0

    async def embed_voice(self, ref_audio: AudioInput, voice_version: str | None = None,
                          timeout: float = 60.0) -> np.ndarray:
        try:
            answer = await self._handle.embed_voice.remote(ref_audio, voice_version, timeout)
        except RayActorError as e:
            raise StageDeadError(f"the replica serving this request died ({type(e).__name__})") from None
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def stats(self, timeout: float = 10.0) -> dict[str, StageStats]:
        answers = await self._handle.broadcast("stats").results_async(timeout_s=timeout, return_exceptions=True)
        stats: dict[str, StageStats] = {}
        for answer in answers:
            if isinstance(answer, BaseException):
                continue  # a replica that is going away
            replica, replica_stats, restarts = answer
            self._replica_restarts[replica] = restarts
            stats.update({f"{replica}/{stage}": s for stage, s in replica_stats.items()})
        return stats


class RayTextStream:
    """tts_client.SpeechTextStream of a text_session call."""

    def __init__(self, relay: ray.actor.ActorHandle, session: str, chunks: AsyncIterator) -> None:
        self.relay, self.session, self.chunks = relay, session, chunks
        self.text_done = False

    async def append(self, text: str) -> None:
        if self.text_done:
            raise RuntimeError("the text has been finished")
        await self.relay.push.remote(self.session, "text", text)

    async def finish(self) -> None:
        if not self.text_done:
            self.text_done = True
            await self.relay.push.remote(self.session, "finish")

    def __aiter__(self) -> AsyncIterator[SpeechChunk]:
        return self.chunks

    async def aclose(self) -> None:
        await self.chunks.aclose()
        await self.relay.push.remote(self.session, "closed")


async def _chunks(call: Callable[[], DeploymentResponseGenerator]) -> AsyncIterator:
    """The items of `call`'s replica as a local pipeline's iterator gives them: chunks, then the error that ended
    them raised; a replica that died is StageDeadError (503, as a dead stage). The call is made when iteration
    starts (an iterator never started leaves nothing running), and closing the iterator cancels it."""
    responses = call()
    try:
        async for item in responses:
            if isinstance(item, BaseException):
                raise item
            yield item
    except RayActorError as e:
        raise StageDeadError(f"the replica serving this request died ({type(e).__name__})") from None
    finally:
        responses.cancel()
