"""The orchestrator: owns the stage processes, the ring and the sockets, and streams each request's audio.

    async with AsyncTTSEngine(model_dir, load_stage_config("cpu_tiny")) as engine:
        async for chunk in engine.generate(SynthesisRequest(text="Hello.", voice="ryan")):
            play(chunk.audio)            # float32 (or int16) at 24 kHz; the last chunk carries `usage`

Request life: tokenize (single-worker executor: the tokenizer is not re-entrant) → Register in stage 1 →
AddRequest to stage 0 → audio events routed to the request's queue → final usage when stage 0 reported the
frame count and stage 1 the last audio. Cancelling the consumer aborts the request in both stages. A stage that
dies (process sentinel) fails every in-flight request with `StageDeadError` at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from omni_tts.config import PipelineConfig, code2wav_lent_threads, stage_environment, stage_threads
from omni_tts.connectors.shm_ring import RingOwner, cleanup_stale_segments
from omni_tts.models.qwen3_tts.config import Qwen3TTSConfig, read_json
from omni_tts.models.qwen3_tts.generation import token_limit
from omni_tts.models.qwen3_tts.model import SAMPLE_RATE, reference_audio_24k
from omni_tts.models.qwen3_tts.prompt import PromptBuilder, RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams, resolve_sampling
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer
from omni_tts.stages import code2wav_stage, talker_stage
from omni_tts.stages.protocol import (Abort, AddRequest, AudioChunk, GetStats, Ready, Register, Shutdown,
                                      StageEvent, StageFailed, StageLaunch, StageStats, TalkerDone)

logger = logging.getLogger(__name__)


class StageDeadError(RuntimeError):
    """A stage process died; in-flight requests fail with this and the engine is unhealthy."""


class RequestFailed(RuntimeError):
    """A stage rejected or failed this request (the others keep running)."""


@dataclass
class Usage:
    input_tokens: int        # text tokens of the input
    prompt_rows: int         # talker prefill positions
    output_frames: int
    audio_seconds: float
    finish_reason: str       # "stop" | "length"


@dataclass
class GenerationChunk:
    audio: np.ndarray        # float32 or int16 samples at 24 kHz
    usage: Usage | None = None   # only on the final chunk (whose audio may be empty)


@dataclass
class _Request:
    queue: asyncio.Queue
    input_tokens: int
    num_samples: int = 0
    talker_done: TalkerDone | None = None
    audio_done: bool = False


@dataclass
class _Stage:
    name: str
    process: multiprocessing.Process
    command: zmq.asyncio.Socket
    pid: int | None = None
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    stats: asyncio.Future | None = None


class AsyncTTSEngine:
    def __init__(self, model_dir: str, pipeline: PipelineConfig, startup_timeout: float = 300.0) -> None:
        self.model_dir, self.pipeline = model_dir, pipeline
        self.startup_timeout = startup_timeout
        self.threads = stage_threads(pipeline)
        self.config = Qwen3TTSConfig.load(model_dir)
        gen_path = os.path.join(model_dir, "generation_config.json")
        self.generation_config = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self.prompts = PromptBuilder(self.config, load_text_tokenizer(model_dir))
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tts-tokenizer")
        self.audio_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="omni-tts-audio")
        self.requests: dict[str, _Request] = {}
        self.stages: dict[str, _Stage] = {}
        self.dead: str | None = None
        self._ring: RingOwner | None = None
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._event_task: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StageEvent)
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncTTSEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        cleanup_stale_segments()
        conn, stages = self.pipeline.connector, self.pipeline.stages
        self._ring = RingOwner.create(conn.ring_slots, conn.ring_slot_frames, self.config.talker.num_code_groups,
                                      edge="codec")
        self._ipc_dir = tempfile.mkdtemp(prefix=f"omni_tts_{os.getpid()}_ctl_")
        self._ctx = zmq.asyncio.Context()
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        event_address = f"ipc://{self._ipc_dir}/events"
        self._events.bind(event_address)
        self._event_task = asyncio.create_task(self._event_loop())
        spawn = multiprocessing.get_context("spawn")
        loop = asyncio.get_running_loop()
        for name, entry, cfg in (("talker", talker_stage.main, stages.talker),
                                 ("code2wav", code2wav_stage.main, stages.code2wav)):
            address = f"ipc://{self._ipc_dir}/{name}"
            launch = StageLaunch(stage=name, model_dir=self.model_dir, device=cfg.device, dtype=cfg.dtype,
                                 max_batch_size=(min(cfg.max_batch_size, cfg.num_cache_rows) if name == "talker"
                                                 else cfg.max_batch_size),
                                 command_address=address, event_address=event_address, ring=self._ring.spec,
                                 initial_chunk_frames=conn.initial_codec_chunk_frames,
                                 chunk_frames=conn.codec_chunk_frames, threads=self.threads[name],
                                 **({"max_model_len": cfg.max_model_len,
                                     "max_prefill_tokens_per_step": cfg.max_prefill_tokens_per_step,
                                     "max_text_tokens": cfg.max_text_tokens, "enforce_eager": cfg.enforce_eager}
                                    if name == "talker"
                                    else {"max_frames_per_step": cfg.max_frames_per_step,
                                          "lent_threads": code2wav_lent_threads(self.pipeline, self.threads)}))
            process = spawn.Process(target=entry, args=(msgspec.msgpack.encode(launch),), name=f"omni-tts-{name}",
                                    daemon=True)
            with stage_environment(name):
                process.start()
            command = self._ctx.socket(zmq.PUSH)
            command.setsockopt(zmq.LINGER, 0)
            command.connect(address)
            stage = self.stages[name] = _Stage(name, process, command)
            loop.add_reader(process.sentinel, self._on_stage_exit, stage)
        try:
            await asyncio.wait_for(asyncio.gather(*(s.ready for s in self.stages.values())), self.startup_timeout)
        except BaseException:
            await self.shutdown()
            raise

    async def shutdown(self) -> None:
        """Stop the stages (gracefully, then by force), unlink the ring, close sockets and executors."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        for stage in self.stages.values():
            loop.remove_reader(stage.process.sentinel)
            if stage.process.is_alive():
                try:
                    await stage.command.send(self._encoder.encode(Shutdown()))
                except zmq.ZMQError:
                    pass
        for stage in self.stages.values():
            await loop.run_in_executor(None, _stop_process, stage.process)
        self._fail_all(StageDeadError("the engine is shutting down"))
        if self._event_task is not None:
            self._event_task.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._ring is not None:
            self._ring.close()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.audio_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return not self._closed and self.dead is None and all(s.process.is_alive() for s in self.stages.values())

    # --- requests -------------------------------------------------------------------------------------------
    async def generate(self, request: SynthesisRequest, request_id: str | None = None,
                       output_dtype: str = "float32", initial_chunk_frames: int | None = None,
                       voice_key: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream one request's audio. RequestError for bad input (before anything runs), StageDeadError or
        RequestFailed if it cannot finish. Closing or cancelling the iterator aborts the request everywhere.
        initial_chunk_frames overrides the connector's first-chunk size for this request. voice_key names the
        immutable clip that request.ref_audio holds (an uploaded voice's version): stage 0 caches its voice
        features under it, so the same key must never stand for other audio."""
        if output_dtype not in ("float32", "int16"):
            raise ValueError(f"output_dtype must be float32 or int16, got {output_dtype!r}")
        limit = self.pipeline.connector.ring_slot_frames
        if initial_chunk_frames is not None and not 1 <= initial_chunk_frames <= limit:
            raise RequestError("initial_codec_chunk_frames", f"initial_codec_chunk_frames must be in 1..{limit}, "
                                                             f"got {initial_chunk_frames}")
        self._check_alive()
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise RequestError("request_id", f"request id {rid!r} is already in flight")
        prompt = await loop.run_in_executor(self.tokenizer_pool, self.prompts.tokenize, request)
        sampling = self._resolve_sampling(request.sampling)
        ref_audio = None
        if self.config.tts_model_type == "base":
            wav = await loop.run_in_executor(self.audio_pool, reference_audio_24k, request.ref_audio)
            ref_audio = wav.astype(np.float32).tobytes()
        self._check_alive()
        state = self.requests[rid] = _Request(asyncio.Queue(), len(prompt.text_ids))
        finished = False
        try:
            await self.stages["code2wav"].command.send(self._encoder.encode(Register(rid)))
            await self.stages["talker"].command.send(self._encoder.encode(AddRequest(
                request_id=rid, role_ids=prompt.role_ids, text_ids=prompt.text_ids, instruct_ids=prompt.instruct_ids,
                language_id=prompt.language_id, speaker_id=prompt.speaker_id, non_streaming=prompt.non_streaming,
                ref_text_ids=prompt.ref_text_ids, ref_audio=ref_audio,
                sampling=sampling,
                max_tokens=token_limit(sampling.max_new_tokens, len(prompt.text_ids)),
                initial_chunk_frames=initial_chunk_frames, voice_key=voice_key if ref_audio is not None else None)))
            while True:
                item = state.queue.get_nowait() if not state.queue.empty() else await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if output_dtype == "int16":
                    item.audio = (np.clip(item.audio, -1.0, 1.0) * 32767.0).round().astype(np.int16)
                yield item
                if item.usage is not None:
                    finished = True
                    return
        finally:
            self.requests.pop(rid, None)
            if not finished and self.dead is None and not self._closed:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Free the request in every stage (each drops it within one step)."""
        message = self._encoder.encode(Abort(request_id))
        for stage in self.stages.values():
            try:
                await stage.command.send(message)
            except zmq.ZMQError:
                pass

    async def stats(self, timeout: float = 10.0) -> dict[str, StageStats]:
        """Ask both stages for their live request ids, step counts and CPU time."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        for stage in self.stages.values():
            stage.stats = loop.create_future()
            await stage.command.send(self._encoder.encode(GetStats()))
        results = await asyncio.wait_for(asyncio.gather(*(s.stats for s in self.stages.values())), timeout)
        return dict(zip(self.stages, results))

    def stage_pids(self) -> dict[str, int]:
        return {name: stage.process.pid for name, stage in self.stages.items()}

    def _resolve_sampling(self, params: SamplingParams):
        defaults = msgspec.structs.asdict(self.pipeline.sampling)
        merged = SamplingParams(**{k: (getattr(params, k) if getattr(params, k) is not None else defaults.get(k))
                                   for k in SamplingParams.__dataclass_fields__})
        try:
            return resolve_sampling(merged, self.generation_config)
        except ValueError as e:
            raise RequestError(str(e).split(" ", 1)[0], str(e)) from None

    def _check_alive(self) -> None:
        if self._closed:
            raise StageDeadError("the engine is shut down")
        if self.dead is not None:
            raise StageDeadError(f"stage {self.dead} is dead")

    # --- events from the stages -----------------------------------------------------------------------------
    async def _event_loop(self) -> None:
        while True:
            event = self._decoder.decode(await self._events.recv())
            if isinstance(event, AudioChunk):
                self._on_audio(event)
            elif isinstance(event, TalkerDone):
                self._on_talker_done(event)
            elif isinstance(event, StageStats):
                stage = self.stages[event.stage]
                if stage.stats is not None and not stage.stats.done():
                    stage.stats.set_result(event)
            elif isinstance(event, Ready):
                stage = self.stages[event.stage]
                stage.pid = event.pid
                if not stage.ready.done():
                    stage.ready.set_result(None)
            elif isinstance(event, StageFailed):
                logger.error("stage %s failed:\n%s", event.stage, event.error)
                self._mark_dead(event.stage, event.error.strip().splitlines()[-1])

    def _on_audio(self, event: AudioChunk) -> None:
        state = self.requests.get(event.request_id)
        if state is None:
            return  # aborted meanwhile
        audio = np.frombuffer(event.pcm, dtype=np.float32)
        state.num_samples += audio.shape[0]
        if audio.shape[0]:
            state.queue.put_nowait(GenerationChunk(audio))
        state.audio_done = event.finished
        self._maybe_finish(event.request_id, state)

    def _on_talker_done(self, event: TalkerDone) -> None:
        state = self.requests.get(event.request_id)
        if state is None:
            return
        if event.error is not None:
            state.queue.put_nowait(RequestFailed(event.error))
            asyncio.create_task(self.abort(event.request_id))
            return
        state.talker_done = event
        self._maybe_finish(event.request_id, state)

    def _maybe_finish(self, request_id: str, state: _Request) -> None:
        done = state.talker_done
        if done is None or not state.audio_done:
            return
        usage = Usage(input_tokens=state.input_tokens, prompt_rows=done.num_prompt_rows, output_frames=done.num_frames,
                      audio_seconds=state.num_samples / SAMPLE_RATE, finish_reason=done.finish_reason)
        state.queue.put_nowait(GenerationChunk(np.zeros(0, np.float32), usage))

    def _on_stage_exit(self, stage: _Stage) -> None:
        asyncio.get_running_loop().remove_reader(stage.process.sentinel)
        if not self._closed:
            self._mark_dead(stage.name, f"process {stage.process.pid} exited")

    def _mark_dead(self, name: str, why: str) -> None:
        if self.dead is None:
            self.dead = name
            logger.error("stage %s is dead: %s", name, why)
        error = StageDeadError(f"stage {name} died: {why}")
        for stage in self.stages.values():
            if not stage.ready.done():
                stage.ready.set_exception(error)
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for state in self.requests.values():
            state.queue.put_nowait(error)


def _stop_process(process: multiprocessing.Process) -> None:
    process.join(5)
    if process.is_alive():
        process.terminate()
        process.join(3)
    if process.is_alive():
        process.kill()
        process.join()
