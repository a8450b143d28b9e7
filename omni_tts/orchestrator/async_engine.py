"""The orchestrator: owns the stage processes, the connector and the sockets, and streams each request's audio.

    async with AsyncTTSEngine(model_dir, load_stage_config("cpu_tiny")) as engine:
        async for chunk in engine.generate(SynthesisRequest(text="Hello.", voice="ryan")):
            play(chunk.audio)            # float32 (or int16) at 24 kHz; the last chunk carries `usage`

Request life: tokenize (single-worker executor: the tokenizer is not re-entrant) → Register in stage 1 →
AddRequest to stage 0 → audio events routed to the request's queue → final usage when stage 0 reported the
frame count and stage 1 the last audio. Cancelling the consumer aborts the request in both stages.

Supervision: a stage that exits, reports a failure, stops sending heartbeats or stays inside one loop iteration
too long (hung), and an exception in the event task, each take one path (`_pipeline_failed`): every in-flight
request fails with `StageDeadError` at once, both stage processes are killed, and the pipeline (connector, sockets,
stages) is started again after a backoff. New requests get `StageDeadError` (the server answers 503) until it is
ready. More than `max_restarts` restarts within `restart_window` seconds and the engine gives up (`fatal`), so a
process supervisor can take over. A consumer slower than its audio by more than `max_buffered_seconds` is failed
(`RequestFailed`), so no request can make the server buffer a whole utterance.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

import msgspec
import numpy as np
import torch
import zmq
import zmq.asyncio

from omni_tts.config import PipelineConfig, code2wav_lanes, stage_environment, stage_threads
from omni_tts.connectors import cleanup_stale_segments
from omni_tts.connectors.kinds import ConnectorOwner, create_owner
from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.config import Qwen3TTSConfig, read_json
from omni_tts.models.qwen3_tts.model import SAMPLE_RATE, reference_audio_24k
from omni_tts.models.qwen3_tts.prompt import (PromptBuilder, PromptLimits, RequestError, SynthesisRequest,
                                              TalkerPrompt)
from omni_tts.models.qwen3_tts.sampling_params import ResolvedSampling, SamplingError, SamplingParams, resolve_sampling
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer
from omni_tts.stages import code2wav_stage, talker_stage
from omni_tts.stages.common import HEARTBEAT_INTERVAL
from omni_tts.stages.protocol import (Abort, AddRequest, AudioChunk, GetStats, Heartbeat, Ready, Register, Shutdown,
                                      StageCommand, StageEvent, StageFailed, StageLaunch, StageStats, TalkerDone)

from .types import GenerationChunk, RequestFailed, RequestTimedOut, StageDeadError, Usage

if TYPE_CHECKING:  # text_stream builds on this module
    from .text_stream import TextStream

logger = logging.getLogger(__name__)

# how long an exited stage's StageFailed may take to arrive: the stage sends it before exiting, but the exit can be
# seen first (process sentinel vs. the event socket)
FAILURE_REPORT_GRACE = 0.5


@dataclass
class _Request:
    queue: asyncio.Queue
    input_tokens: int
    stages: dict[str, "_Stage"]  # the pipeline it runs in (a restart replaces the dict)
    num_samples: int = 0
    buffered_samples: int = 0    # queued, not yet taken by the consumer
    talker_done: TalkerDone | None = None
    audio_done: bool = False
    deadlines: dict[str, asyncio.TimerHandle] = field(default_factory=dict)   # by name; each fails the request
    released: bool = False


@dataclass
class _Stage:
    name: str
    process: multiprocessing.Process
    command: zmq.asyncio.Socket
    pid: int | None = None
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    stats: asyncio.Future | None = None
    heartbeat_at: float = field(default_factory=time.monotonic)
    busy_seconds: float = 0.0
    reported: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())  # StageFailed
    exit_wait: asyncio.Task | None = None   # after the process exited: waits for its report


class AsyncTTSEngine:
    def __init__(self, model_dir: str, pipeline: PipelineConfig, startup_timeout: float = 300.0,
                 heartbeat_timeout: float = 5.0, step_timeout: float = 120.0, max_restarts: int = 5,
                 restart_window: float = 600.0, max_buffered_seconds: float = 60.0, cpus: int | None = None) -> None:
        """heartbeat_timeout: seconds without a heartbeat before a ready stage counts as hung (stopped, or its
        process starved); step_timeout: seconds one loop iteration may take (a deadlocked step). Restarts beyond
        max_restarts within restart_window make the engine give up. cpus: the cores the CPU stages' threads share
        (default: those this process may run on)."""
        self.model_dir, self.pipeline = model_dir, pipeline
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout, self.step_timeout = heartbeat_timeout, step_timeout
        self.max_restarts, self.restart_window = max_restarts, restart_window
        self.max_buffered_samples = int(max_buffered_seconds * SAMPLE_RATE)
        check_devices(pipeline)
        self.threads = stage_threads(pipeline, cpus)
        talker, code2wav = pipeline.stages.talker, pipeline.stages.code2wav
        # requests each stage runs together: the talker is also bounded by its KV cache rows
        self.batch_sizes = {"talker": min(talker.max_batch_size, talker.num_cache_rows),
                            "code2wav": code2wav.max_batch_size}
        self.config = Qwen3TTSConfig.load(model_dir)
        gen_path = os.path.join(model_dir, "generation_config.json")
        self.generation_config = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self.prompts = load_prompts(model_dir, self.config, pipeline)
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tts-tokenizer")
        self.audio_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="omni-tts-audio")
        self.requests: dict[str, _Request] = {}
        self.stages: dict[str, _Stage] = {}
        self.down: str | None = None        # the stage (or "orchestrator") whose failure is being recovered from
        self.down_reason: str | None = None
        self._failed = False                # this pipeline has failed (start() or _recover handles a starting one)
        self.fatal: str | None = None       # why the engine gave up restarting
        self.restarts: collections.Counter[str] = collections.Counter()  # by the stage that failed
        self._restart_times: collections.deque[float] = collections.deque()
        self._connector: ConnectorOwner | None = None
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []    # this pipeline's event and watchdog tasks
        self._recovery: asyncio.Task | None = None
        self.on_fatal: Callable[[str], None] | None = None   # called once when the engine gives up
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
        """Start the pipeline; raises (and cleans up) if a stage cannot start."""
        cleanup_stale_segments()
        self._ctx = zmq.asyncio.Context()
        try:
            await self._start_pipeline()
        except BaseException:
            await self.shutdown()
            raise

    async def _start_pipeline(self) -> None:
        """Ring, control sockets and both stage processes; returns when both are ready."""
        conn, stages = self.pipeline.connector, self.pipeline.stages
        self._failed = False
        self._connector = create_owner(conn, self.config.talker.num_code_groups)
        self._ipc_dir = tempfile.mkdtemp(prefix=f"omni_tts_{os.getpid()}_ctl_")
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        event_address = f"ipc://{self._ipc_dir}/events"
        self._events.bind(event_address)
        self._tasks = [asyncio.create_task(self._event_loop(self._events)), asyncio.create_task(self._watchdog())]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        spawn = multiprocessing.get_context("spawn")
        loop = asyncio.get_running_loop()
        self.stages = {}
        for name, entry, cfg in (("talker", talker_stage.main, stages.talker),
                                 ("code2wav", code2wav_stage.main, stages.code2wav)):
            address = f"ipc://{self._ipc_dir}/{name}"
            launch = StageLaunch(stage=name, model_dir=self.model_dir, device=cfg.device, dtype=cfg.dtype,
                                 max_batch_size=self.batch_sizes[name],
                                 command_address=address, event_address=event_address, connector=self._connector.spec,
                                 initial_chunk_frames=conn.initial_codec_chunk_frames,
                                 chunk_frames=conn.codec_chunk_frames, threads=self.threads[name],
                                 log_level=logging.getLogger("omni_tts").getEffectiveLevel(),
                                 **({"max_model_len": cfg.max_model_len,
                                     "max_prefill_tokens_per_step": cfg.max_prefill_tokens_per_step,
                                     "max_text_tokens": cfg.max_text_tokens, "enforce_eager": cfg.enforce_eager}
                                    if name == "talker"
                                    else {"frame_budget": cfg.max_frames_per_step,
                                          "lanes": code2wav_lanes(self.pipeline, self.threads)}))
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
        except TimeoutError:
            raise StageDeadError(f"the stages were not ready within {self.startup_timeout:g} s") from None

    async def _stop_pipeline(self, graceful: bool) -> None:
        """Stop the stages (gracefully, else kill them at once), then drop the connector, sockets and tasks."""
        loop = asyncio.get_running_loop()
        for stage in self.stages.values():
            loop.remove_reader(stage.process.sentinel)
            if stage.exit_wait is not None:
                stage.exit_wait.cancel()
            if graceful and stage.process.is_alive():
                try:
                    await stage.command.send(self._encoder.encode(Shutdown()))
                except zmq.ZMQError:
                    pass
        for stage in self.stages.values():
            if not graceful and stage.process.is_alive():
                stage.process.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            await loop.run_in_executor(None, _stop_process, stage.process)
            stage.command.close(linger=0)
        for task in self._tasks:
            task.remove_done_callback(self._on_task_done)
            task.cancel()
        self._tasks = []
        if self._events is not None:
            self._events.close(linger=0)
            self._events = None
        if self._connector is not None:
            self._connector.close()
            self._connector = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    async def shutdown(self) -> None:
        """Stop the stages (gracefully, then by force), drop the connector, close sockets and executors."""
        if self._closed:
            return
        self._closed = True
        if self._recovery is not None:
            self._recovery.cancel()
        await self._stop_pipeline(graceful=True)
        self._fail_all(StageDeadError("the engine is shutting down"))
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.audio_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return (not self._closed and self.down is None and bool(self.stages)
                and all(s.process.is_alive() for s in self.stages.values()))

    # --- requests -------------------------------------------------------------------------------------------
    async def generate(self, request: SynthesisRequest, request_id: str | None = None,
                       output_dtype: str = "float32", initial_chunk_frames: int | None = None,
                       voice_key: str | None = None, first_audio_timeout: float | None = None,
                       timeout: float | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream one request's audio. RequestError for bad input (before anything runs), StageDeadError or
        RequestFailed if it cannot finish, RequestTimedOut past `first_audio_timeout` / `timeout` seconds from the
        call (the request is then aborted). Closing or cancelling the iterator aborts the request everywhere.
        initial_chunk_frames overrides the connector's first-chunk size for this request. voice_key names the
        immutable clip that request.ref_audio holds (an uploaded voice's version): stage 0 caches its voice
        features under it, so the same key must never stand for other audio."""
        started = asyncio.get_running_loop().time()
        rid, prompt, sampling, ref_audio = await self._prepare(request, request_id, output_dtype,
                                                               initial_chunk_frames, text_open=False)
        state = self._register(rid, len(prompt.text_ids))
        chunks = self._audio(rid, state, output_dtype)
        try:
            await self._send_request(rid, state, self._add_request(
                rid, prompt, sampling, ref_audio, token_limit(sampling.max_new_tokens, len(prompt.text_ids)),
                initial_chunk_frames, voice_key, text_open=False))
            if first_audio_timeout is not None:
                self._set_deadline(rid, state, "first_audio", started + first_audio_timeout,
                                   f"no audio within {first_audio_timeout:g} s")
            if timeout is not None:
                self._set_deadline(rid, state, "end", started + timeout,
                                   f"the speech did not finish within {timeout:g} s")
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            await self._release(rid, state)

    async def open_text_stream(self, request: SynthesisRequest, request_id: str | None = None,
                               output_dtype: str = "float32", initial_chunk_frames: int | None = None,
                               voice_key: str | None = None, first_audio_timeout: float | None = None,
                               timeout: float | None = None, idle_timeout: float = 30.0) -> "TextStream":
        """A request whose text arrives in pieces (request.text is ignored): `append` the text as it comes,
        `finish` it, and iterate the stream for the audio, as from `generate`, which it equals for the whole text
        in the streaming layout (non_streaming_mode None or False). The arguments are `generate`'s;
        first_audio_timeout counts from `finish`, and the request fails with RequestTimedOut when no text arrives
        for idle_timeout seconds before `finish`. RequestError for bad input; close it to abort."""
        from .text_stream import TextStream

        started = asyncio.get_running_loop().time()
        rid, prompt, sampling, ref_audio = await self._prepare(request, request_id, output_dtype,
                                                               initial_chunk_frames, text_open=True)
        state = self._register(rid, 0)
        if timeout is not None:
            self._set_deadline(rid, state, "end", started + timeout,
                               f"the speech did not finish within {timeout:g} s")
        stream = TextStream(self, rid, state, prompt, sampling, ref_audio, output_dtype, initial_chunk_frames,
                            voice_key, first_audio_timeout, idle_timeout)
        stream.wait_for_text()
        return stream

    async def _prepare(self, request: SynthesisRequest, request_id: str | None, output_dtype: str,
                       initial_chunk_frames: int | None, text_open: bool):
        """Validate and tokenize a request, resolve its sampling and read its reference audio (Base)."""
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
        prompt = await loop.run_in_executor(self.tokenizer_pool, self.prompts.tokenize, request, text_open)
        sampling = self._resolve_sampling(request.sampling)
        ref_audio = None
        if self.config.tts_model_type == "base":
            wav = await loop.run_in_executor(self.audio_pool, reference_audio_24k, request.ref_audio)
            ref_audio = wav.astype(np.float32).tobytes()
        self._check_alive()
        if rid in self.requests:
            raise RequestError("request_id", f"request id {rid!r} is already in flight")
        return rid, prompt, sampling, ref_audio

    def _register(self, rid: str, input_tokens: int) -> _Request:
        state = self.requests[rid] = _Request(asyncio.Queue(), input_tokens, self.stages)
        return state

    @staticmethod
    def _add_request(rid: str, prompt: TalkerPrompt, sampling: ResolvedSampling, ref_audio: bytes | None,
                     max_tokens: int, initial_chunk_frames: int | None, voice_key: str | None,
                     text_open: bool) -> AddRequest:
        return AddRequest(
            request_id=rid, role_ids=prompt.role_ids, text_ids=prompt.text_ids, instruct_ids=prompt.instruct_ids,
            language_id=prompt.language_id, speaker_id=prompt.speaker_id, non_streaming=prompt.non_streaming,
            ref_text_ids=prompt.ref_text_ids, ref_audio=ref_audio, sampling=sampling, max_tokens=max_tokens,
            initial_chunk_frames=initial_chunk_frames, voice_key=voice_key if ref_audio is not None else None,
            text_open=text_open)

    async def _send_request(self, rid: str, state: _Request, add: AddRequest) -> None:
        """Register the request in stage 1, then add it to stage 0."""
        await self._send(state, "code2wav", Register(rid))
        await self._send(state, "talker", add)
        if self.requests.get(rid) is not state:  # failed while being sent: its Abort may have gone first
            await self.abort(rid)

    async def _send(self, state: _Request, stage: str, message: StageCommand) -> None:
        try:
            await state.stages[stage].command.send(self._encoder.encode(message))
        except zmq.ZMQError:  # the pipeline was torn down meanwhile
            raise StageDeadError(f"stage {self.down or 'pipeline'} is restarting") from None

    async def _audio(self, rid: str, state: _Request, output_dtype: str) -> AsyncIterator[GenerationChunk]:
        """The request's chunks until its usage; the failure that ends it is raised (it left the stages)."""
        finished = False
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # its failure removed it from the stages (or the pipeline)
                    raise item
                state.buffered_samples -= item.audio.shape[0]
                if output_dtype == "int16":
                    item.audio = (np.clip(item.audio, -1.0, 1.0) * 32767.0).round().astype(np.int16)
                yield item
                if item.usage is not None:
                    finished = True
                    return
        finally:
            await self._release(rid, state, abort=not finished)

    async def _release(self, rid: str, state: _Request, abort: bool = True) -> None:
        """The request leaves the engine (once): its deadlines are off and, unless it ended, both stages drop it."""
        if state.released:
            return
        state.released = True
        if self.requests.get(rid) is state:
            del self.requests[rid]
        for deadline in state.deadlines.values():
            deadline.cancel()
        if abort and state.stages is self.stages and self.down is None and not self._closed:
            await self.abort(rid)

    def _set_deadline(self, rid: str, state: _Request, name: str, at: float, message: str) -> None:
        """At loop time `at` the request fails with RequestTimedOut(message) (a deadline of that name is
        replaced)."""
        if state.released:
            return
        if name in state.deadlines:
            state.deadlines[name].cancel()

        def expire() -> None:
            self._fail(rid, state, RequestTimedOut(message, before_first_audio=state.num_samples == 0))
        state.deadlines[name] = asyncio.get_running_loop().call_at(at, expire)

    def _fail(self, rid: str, state: _Request, error: BaseException) -> None:
        """One request fails: its consumer gets `error` next, both stages drop it."""
        if self.requests.get(rid) is not state:
            return  # it ended meanwhile
        del self.requests[rid]
        for deadline in state.deadlines.values():
            deadline.cancel()
        state.queue.put_nowait(error)
        asyncio.create_task(self.abort(rid))

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

    def _resolve_sampling(self, params: SamplingParams) -> ResolvedSampling:
        try:
            return resolve_sampling(params, self.generation_config, self.pipeline.sampling)
        except SamplingError as e:
            raise RequestError(e.param, str(e)) from None

    def _check_alive(self) -> None:
        if self._closed:
            raise StageDeadError("the engine is shut down")
        if self.fatal is not None:
            raise StageDeadError(f"the pipeline failed for good: {self.fatal}")
        if self.down is not None:
            raise StageDeadError(f"stage {self.down} failed and is restarting")

    # --- events from the stages -----------------------------------------------------------------------------
    async def _event_loop(self, events: zmq.asyncio.Socket) -> None:
        # an exception here ends the task; _on_task_done turns that into a pipeline failure
        while True:
            event = self._decoder.decode(await events.recv())
            if isinstance(event, AudioChunk):
                self._on_audio(event)
            elif isinstance(event, TalkerDone):
                self._on_talker_done(event)
            elif isinstance(event, Heartbeat):
                stage = self.stages[event.stage]
                stage.heartbeat_at, stage.busy_seconds = time.monotonic(), event.busy_seconds
            elif isinstance(event, StageStats):
                stage = self.stages[event.stage]
                if stage.stats is not None and not stage.stats.done():
                    stage.stats.set_result(event)
            elif isinstance(event, Ready):
                stage = self.stages[event.stage]
                stage.pid, stage.heartbeat_at = event.pid, time.monotonic()
                if not stage.ready.done():
                    stage.ready.set_result(None)
            elif isinstance(event, StageFailed):
                stage = self.stages[event.stage]
                serving = stage.ready.done() and stage.ready.exception() is None
                # at start-up the message reaches the caller (start() raises it); the traceback is for debugging
                logger.log(logging.ERROR if serving else logging.DEBUG, "stage %s failed:\n%s", event.stage,
                           event.error)
                if not stage.reported.done():
                    stage.reported.set_result(None)
                self._pipeline_failed(event.stage, event.message)

    async def _watchdog(self) -> None:
        """A ready stage that sends no heartbeat (stopped, or starved of CPU) or stays in one loop iteration too
        long (deadlocked) is hung."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            now = time.monotonic()
            for stage in self.stages.values():
                if not stage.ready.done():
                    continue  # loading: start() waits for Ready with its own timeout
                if now - stage.heartbeat_at > self.heartbeat_timeout:
                    self._pipeline_failed(stage.name, f"hung: no heartbeat for {now - stage.heartbeat_at:.1f} s")
                    return
                if stage.busy_seconds > self.step_timeout:
                    self._pipeline_failed(stage.name, f"hung: one step has run for {stage.busy_seconds:.0f} s")
                    return

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        logger.error("orchestrator task %s ended", task.get_coro().__qualname__,
                     exc_info=(type(error), error, error.__traceback__) if error else None)
        self._pipeline_failed("orchestrator", f"{type(error).__name__}: {error}" if error else "task ended")

    def _on_audio(self, event: AudioChunk) -> None:
        state = self.requests.get(event.request_id)
        if state is None:
            return  # aborted meanwhile
        if event.error is not None:
            self._fail(event.request_id, state, RequestFailed(event.error))
            return
        audio = np.frombuffer(event.pcm, dtype=np.float32)
        state.num_samples += audio.shape[0]
        if audio.shape[0] or event.finished:
            first_audio = state.deadlines.pop("first_audio", None)
            if first_audio is not None:
                first_audio.cancel()
        if audio.shape[0]:
            state.buffered_samples += audio.shape[0]
            if state.buffered_samples > self.max_buffered_samples:  # the consumer stalls: free its memory now
                self._fail(event.request_id, state, RequestFailed(
                    f"the client read the audio too slowly (over {self.max_buffered_samples / SAMPLE_RATE:.0f} s "
                    "of audio waiting)"))
                return
            state.queue.put_nowait(GenerationChunk(audio))
        state.audio_done = event.finished
        self._maybe_finish(event.request_id, state)

    def _on_talker_done(self, event: TalkerDone) -> None:
        state = self.requests.get(event.request_id)
        if state is None:
            return
        if event.error is not None:
            self._fail(event.request_id, state, RequestFailed(event.error))
            return
        state.talker_done = event
        self._maybe_finish(event.request_id, state)

    def _maybe_finish(self, request_id: str, state: _Request) -> None:
        done = state.talker_done
        if done is None or not state.audio_done:
            return
        usage = Usage(input_tokens=state.input_tokens, prompt_rows=done.num_prompt_rows, output_frames=done.num_frames,
                      audio_seconds=state.num_samples / SAMPLE_RATE, finish_reason=done.finish_reason)
        for deadline in state.deadlines.values():
            deadline.cancel()
        state.queue.put_nowait(GenerationChunk(np.zeros(0, np.float32), usage))

    def _on_stage_exit(self, stage: _Stage) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(stage.process.sentinel)
        if (stage.process.exitcode or 0) < 0:  # killed by a signal: it reported nothing
            self._pipeline_failed(stage.name, exit_description(stage.process))
        else:
            stage.exit_wait = loop.create_task(self._await_failure_report(stage))

    async def _await_failure_report(self, stage: _Stage) -> None:
        """A stage that raised sent StageFailed before exiting: its own error text is the reason, not the exit."""
        try:
            await asyncio.wait_for(asyncio.shield(stage.reported), FAILURE_REPORT_GRACE)
        except TimeoutError:
            self._pipeline_failed(stage.name, exit_description(stage.process))

    # --- failure and recovery -------------------------------------------------------------------------------
    def _pipeline_failed(self, name: str, why: str) -> None:
        """The one place a failure lands: fail every in-flight request, then restart the pipeline. A pipeline that
        is still starting fails its start instead (start() raises, _recover retries)."""
        if self._closed or self._failed:
            return  # already failed (the other stage's exit, a late event) or shutting down
        self._failed = True
        error = StageDeadError(f"stage {name} failed: {why}")
        starting = [stage for stage in self.stages.values() if not stage.ready.done()]
        for stage in starting:
            stage.ready.set_exception(error)
            stage.ready.exception()  # retrieved: the other stage's future may have no waiter left
        if starting:
            return
        self.down, self.down_reason = name, why
        logger.error("stage %s failed: %s; restarting the pipeline", name, why)
        self._fail_all(error)
        self._recovery = asyncio.create_task(self._recover(name))

    async def _recover(self, name: str) -> None:
        delay = 0.0
        while not self._closed:
            await self._stop_pipeline(graceful=False)
            now = time.monotonic()
            while self._restart_times and now - self._restart_times[0] > self.restart_window:
                self._restart_times.popleft()
            if len(self._restart_times) >= self.max_restarts:
                self.fatal = (f"{len(self._restart_times)} restarts within {self.restart_window:.0f} s; last: "
                              f"stage {self.down} {self.down_reason}")
                logger.critical("giving up: %s", self.fatal)
                if self.on_fatal is not None:
                    self.on_fatal(self.fatal)
                return
            await asyncio.sleep(delay)
            self._restart_times.append(time.monotonic())
            self.restarts[name] += 1
            try:
                await self._start_pipeline()
            except Exception as e:  # noqa: BLE001 — any start failure is retried, then given up on
                logger.error("pipeline restart failed: %s: %s", type(e).__name__, e)
                delay = min(max(2 * delay, 1.0), 30.0)
                continue
            self.down = self.down_reason = None
            logger.warning("pipeline restarted after stage %s failed (restart %d)", name, sum(self.restarts.values()))
            return

    def _fail_all(self, error: BaseException) -> None:
        for state in self.requests.values():
            for deadline in state.deadlines.values():
                deadline.cancel()
            state.queue.put_nowait(error)
        self.requests.clear()


def load_prompts(model_dir: str, config: Qwen3TTSConfig, pipeline: PipelineConfig) -> PromptBuilder:
    """The checkpoint's prompt builder (tokenizer, speakers, languages) within the talker's limits."""
    talker = pipeline.stages.talker
    return PromptBuilder(config, load_text_tokenizer(model_dir), PromptLimits(talker.max_text_tokens,
                                                                              talker.max_model_len))


def check_devices(pipeline: PipelineConfig) -> None:
    """ValueError naming every stage whose device this machine lacks (before any process is spawned for it)."""
    num_cuda = torch.cuda.device_count()
    missing: dict[str, list[str]] = {}
    for name, cfg in pipeline.stages.by_name().items():
        if cfg.device.startswith("cuda") and int(cfg.device.partition(":")[2] or 0) >= num_cuda:
            missing.setdefault(cfg.device, []).append(name)
    if missing:
        found = f"{num_cuda} CUDA device{'s' if num_cuda > 1 else ''}" if num_cuda else "no CUDA device"
        raise ValueError("; ".join(f"device {device} of stage {', '.join(names)} does not exist"
                                   for device, names in missing.items()) + f" (torch sees {found})")


def exit_description(process: multiprocessing.Process) -> str:
    """How a stage process ended, for a failure reason: `exited with status N`, `killed by signal SIGKILL`."""
    code = process.exitcode
    if code is None:  # its sentinel can close a moment before the exit status is there to collect
        return f"process {process.pid} exited"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _stop_process(process: multiprocessing.Process) -> None:
    process.join(5)
    if process.is_alive():
        process.terminate()
        process.join(3)
    if process.is_alive():
        process.kill()
        process.join()

