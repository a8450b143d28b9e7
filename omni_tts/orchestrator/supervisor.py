"""The process supervisor: starts the pipeline (connector, control sockets, both stage processes), watches it, and
restarts it when a stage fails.

A server of several models runs a talker per model beside one code2wav per distinct decoder (model_layout.py); a
talker whose model sits idle can be unloaded (`unload`: its process stops, its connector stays with code2wav) and
loaded again on demand (`load`), neither of which touches the other stages.

A stage that exits, reports a failure, stops sending heartbeats or stays inside one loop iteration too long (hung),
and an exception in the event task, each take one path (`_pipeline_failed`): `on_failure` fails every in-flight
request at once, both stage processes are killed, and the pipeline is started again after a backoff. More than
`max_restarts` restarts within `restart_window` seconds and the supervisor gives up (`fatal`), so a process
supervisor outside can take over (the watching and restarting are processes.py's, which the aligner's client
shares). Nothing here knows about requests: the stage client (stage_client.py) decodes the events and reports the
stages' Ready, Heartbeat and StageFailed back here.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

import msgspec
import torch
import zmq
import zmq.asyncio

from omni_tts.config import PipelineConfig, code2wav_lanes, stage_threads
from omni_tts.config.settings import SupervisionSettings
from omni_tts.connectors import cleanup_stale_blocks
from omni_tts.connectors.kinds import ConnectorOwner, ConnectorSpec, create_owner
from omni_tts.stages import code2wav_stage, fused_stage, talker_stage
from omni_tts.stages.messages import AlignerLaunch, Heartbeat, Shutdown, StageLaunch, stage_kind

from .model_layout import PipelineLayout
from .processes import Restarts, StageWatch, spawn, stop_process, wait_ready, watch_hangs
from .types import EngineShutDown, StageDeadError

logger = logging.getLogger(__name__)

# how long an unloading talker waits for code2wav to give back its connector slots (it is idle: they are on the way)
UNLOAD_RELEASE_WAIT = 2.0


@dataclass(kw_only=True)
class StageProcess(StageWatch):
    command: zmq.asyncio.Socket   # the stage's control socket


class StageSupervisor:
    def __init__(self, layout: PipelineLayout, pipeline: PipelineConfig, num_code_groups: int,
                 on_event: Callable[[bytes], None], on_failure: Callable[[StageDeadError], None],
                 supervision: SupervisionSettings, cpus: int | None = None) -> None:
        """layout: the stages and the model each loads; on_event: each frame the stages send (run in the event task:
        an exception there fails the pipeline); on_failure: the pipeline failed, every request in it fails with this
        error. cpus: the cores the CPU stages' threads share (default: those this process may run on)."""
        self.layout, self.pipeline, self.num_code_groups = layout, pipeline, num_code_groups
        check_layout(layout, pipeline)
        self.on_event, self.on_failure = on_event, on_failure
        self.supervision = supervision
        check_devices(pipeline)
        self.threads = stage_threads(pipeline, cpus)
        talker, code2wav = pipeline.stages.talker, pipeline.stages.code2wav
        # requests each stage runs together: the talker is also bounded by its KV cache rows
        self.batch_sizes = {"talker": min(talker.max_batch_size, talker.num_cache_rows),
                            "code2wav": code2wav.max_batch_size}
        self.stages: dict[str, StageProcess] = {}   # the running ones (an unloaded talker is not)
        self.unloaded: set[str] = set()             # talkers stopped while their model was idle
        self.loras: dict[str, dict[str, str]] = {}   # talker → its LoRA adapters (name → dir), loaded at its start
        self._launches: dict[str, StageLaunch] = {}   # the running pipeline's, by stage (a talker loads from it)
        self.hosted_aligner: AlignerLaunch | None = None   # the forced aligner code2wav's process runs beside it
        self.epoch = 0                      # counts pipeline starts: a request belongs to the one it entered
        self.down: str | None = None        # the stage (or "orchestrator") whose failure is being recovered from
        self.down_reason: str | None = None
        self.restarts: collections.Counter[str] = collections.Counter()  # by the stage that failed
        self.on_fatal: Callable[[str], None] | None = None   # called once on giving up
        self.closed = False
        self._failed = False                # this pipeline has failed (start() or _recover handles a starting one)
        self._started = False               # this pipeline's stages all came up (a talker loads into it later)
        self._restarts = Restarts("pipeline", supervision)
        self._connectors: dict[str, ConnectorOwner] = {}   # by talker stage
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []    # this pipeline's event and watchdog tasks
        self._recovery: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()

    # --- what the pipeline is now ---------------------------------------------------------------------------
    @property
    def connector_spec(self) -> ConnectorSpec | None:
        """The running pipeline's chunk connector (what the stages attach to; of the first model's talker)."""
        return self._connectors["talker"].spec if self._connectors else None

    @property
    def event_address(self) -> str | None:
        """The running pipeline's event socket, where the stages send their events."""
        return f"ipc://{self._ipc_dir}/events" if self._ipc_dir is not None else None

    @property
    def fatal(self) -> str | None:
        """Why the supervisor gave up restarting."""
        return self._restarts.fatal

    @property
    def is_healthy(self) -> bool:
        return (not self.closed and self.down is None and bool(self.stages)
                and all(s.process.is_alive() for s in self.stages.values()))

    def stage_pids(self) -> dict[str, int]:
        return {name: stage.process.pid for name, stage in self.stages.items()}

    def check_alive(self) -> None:
        """StageDeadError unless the pipeline serves now."""
        if self.closed:
            raise EngineShutDown("the engine is shut down")
        if self.fatal is not None:
            raise StageDeadError(f"the pipeline failed for good: {self.fatal}")
        if self.down is not None:
            raise StageDeadError(f"stage {self.down} failed and is restarting")

    async def send(self, stage: str, frame: bytes, epoch: int) -> None:
        """Send a command to a stage of pipeline `epoch`; StageDeadError once that pipeline is gone (or the stage, a
        talker, was unloaded)."""
        if self.closed:
            raise EngineShutDown("the engine is shut down")
        if epoch != self.epoch:
            raise StageDeadError(f"stage {self.down or 'pipeline'} is restarting")
        if stage not in self.stages:
            raise StageDeadError(f"stage {stage} is not running (its model was unloaded)")
        try:
            await self.stages[stage].command.send(frame)
        except zmq.ZMQError:  # the pipeline was torn down meanwhile
            raise StageDeadError(f"stage {self.down or 'pipeline'} is restarting") from None

    # --- what the stages report (decoded by the stage client) -------------------------------------------------
    def on_ready(self, name: str, pid: int) -> None:
        if name in self.stages:   # else an unloaded talker's late event
            self.stages[name].on_ready(pid)

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        if heartbeat.stage in self.stages:
            self.stages[heartbeat.stage].on_heartbeat(heartbeat.busy_seconds, heartbeat.connector_stalled_seconds)

    def on_stage_failed(self, name: str, message: str, traceback: str) -> None:
        stage = self.stages.get(name)
        if stage is None:
            return

        # at start-up the message reaches the caller (start() raises it); the traceback is for debugging
        logger.log(logging.ERROR if stage.serving else logging.DEBUG, "stage %s failed:\n%s", name, traceback)
        stage.on_failed(message)
        self._pipeline_failed(name, message)

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the pipeline; raises (and cleans up) if a stage cannot start."""
        cleanup_stale_blocks()
        self._ctx = zmq.asyncio.Context()
        try:
            await self._start_pipeline()
        except BaseException:
            await self.shutdown()
            raise

    async def shutdown(self) -> None:
        """Stop the stages (gracefully, then by force), drop the connector and close the sockets."""
        if self.closed:
            return
        self.closed = True
        if self._recovery is not None:
            self._recovery.cancel()
        await self._stop_pipeline(graceful=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _start_pipeline(self) -> None:
        """Connectors (one per talker), control sockets and the stage processes (one in the fused layout) but the
        unloaded talkers; returns when they are ready."""
        conn = self.pipeline.connector
        self._failed = self._started = False
        self.epoch += 1
        self._connectors = {talker: create_owner(conn, self.num_code_groups) for talker in self.layout.talkers}
        self._ipc_dir = tempfile.mkdtemp(prefix=f"omni_tts_{os.getpid()}_ctl_")
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(self.event_address)
        self._tasks = [asyncio.create_task(self._event_loop(self._events)),
                       asyncio.create_task(watch_hangs(lambda: self.stages.values(), self.supervision,
                                                     self._pipeline_failed))]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        self.stages = {}
        self._launches = {name: self._launch(name, model_dir, index)
                          for index, (name, model_dir) in enumerate({**self.layout.talkers,
                                                                    **self.layout.decoders}.items())}
        if conn.kind == "local":  # the fused layout runs both stages of its one model in one process
            self._spawn(fused_stage.main, "fused", ("talker", "code2wav"))
        else:
            for talker in self.layout.talkers:
                if talker not in self.unloaded:
                    self._spawn(talker_stage.main, talker, (talker,))
            for code2wav in self.layout.decoders:
                self._spawn(code2wav_stage.main, code2wav, (code2wav,))
        await wait_ready(list(self.stages.values()), self.supervision.startup_timeout)
        self._started = True

    def _spawn(self, entry: Callable[..., None], process_name: str, names: tuple[str, ...]) -> None:
        """Start the process that runs stages `names` of the running pipeline, and watch it."""
        process = spawn(entry, tuple(msgspec.msgpack.encode(self._launches[n]) for n in names),
                        f"omni-tts-{process_name}", names[0])
        for name in names:
            command = self._ctx.socket(zmq.PUSH)
            command.setsockopt(zmq.LINGER, 0)
            command.connect(self._launches[name].command_address)
            self.stages[name] = StageProcess(name=name, process=process, command=command)
        # a process's exit is watched once; a stage that failed names itself in its StageFailed
        first = self.stages[names[0]]
        first.watch_exit(lambda why, name=first.name: self._pipeline_failed(name, why))

    def _launch(self, name: str, model_dir: str, index: int) -> StageLaunch:
        """What stage `name`'s process needs to run it in the pipeline being started (its control socket named by
        its index: a model's name may hold what a path cannot)."""
        kind = stage_kind(name)
        if kind == "talker":
            connector, readers = self._connectors[name].spec, []
        else:
            readers = [self._connectors[talker].spec for talker in self.layout.readers_of(name)]
            connector, readers = readers[0], readers if len(readers) > 1 else []
        return StageLaunch(stage=name, model_dir=model_dir, pipeline=self.pipeline,
                           max_batch_size=self.batch_sizes[kind], threads=self.threads[kind],
                           command_address=f"ipc://{self._ipc_dir}/stage{index}", event_address=self.event_address,
                           connector=connector, connectors=readers,
                           lanes=code2wav_lanes(self.pipeline, self.threads) if kind == "code2wav" else 1,
                           log_level=logging.getLogger("omni_tts").getEffectiveLevel(),
                           aligner=self.hosted_aligner if name == "code2wav" else None,
                           loras=dict(self.loras.get(name, {})))

    # --- a model's talker unloaded while idle, loaded on demand -----------------------------------------------
    async def unload(self, talker: str) -> None:
        """Stop `talker`'s process (its model's memory goes with it) once it has no request (the caller's rule):
        its connector stays, read by code2wav, for its next load. Not a failure: nothing else is touched."""
        stage = self.stages.pop(talker)
        self.unloaded.add(talker)
        stage.unwatch()
        try:
            await stage.command.send(self._encoder.encode(Shutdown(release_wait=UNLOAD_RELEASE_WAIT)))
        except zmq.ZMQError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, stop_process, stage.process)
        stage.command.close(linger=0)
        logger.info("stage %s unloaded", talker)

    async def load(self, talker: str) -> None:
        """Start the unloaded `talker` again in the running pipeline; returns once it is ready. StageDeadError when
        the pipeline does not serve, or the talker does not start (it stays unloaded; the pipeline is untouched)."""
        self.check_alive()
        self.unloaded.discard(talker)
        # the adapters loaded since the pipeline started come back with it
        self._launches[talker] = msgspec.structs.replace(self._launches[talker], loras=dict(self.loras.get(talker, {})))
        self._spawn(talker_stage.main, talker, (talker,))
        try:
            await wait_ready([self.stages[talker]], self.supervision.startup_timeout)
        except BaseException as e:
            stage = self.stages.pop(talker, None)
            self.unloaded.add(talker)
            if stage is not None:
                stage.unwatch()
                stage.process.kill()
                await asyncio.get_running_loop().run_in_executor(None, stop_process, stage.process)
                stage.command.close(linger=0)
            if isinstance(e, Exception) and not isinstance(e, StageDeadError):
                raise StageDeadError(f"stage {talker} did not load: {e}") from e
            raise
        logger.info("stage %s loaded", talker)

    async def _stop_pipeline(self, graceful: bool) -> None:
        """Stop the stages (gracefully, else kill them at once; one still loading reads no command: killed), then drop
        the connector, sockets and tasks."""
        loop = asyncio.get_running_loop()
        loading = {stage.name for stage in self.stages.values() if not stage.serving}
        for stage in self.stages.values():
            stage.unwatch()
            if graceful and stage.name not in loading and stage.process.is_alive():
                try:
                    await stage.command.send(self._encoder.encode(Shutdown()))
                except zmq.ZMQError:
                    pass
        for stage in self.stages.values():
            if (not graceful or stage.name in loading) and stage.process.is_alive():
                stage.process.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            await loop.run_in_executor(None, stop_process, stage.process)
            stage.command.close(linger=0)
        for task in self._tasks:
            task.remove_done_callback(self._on_task_done)
            task.cancel()
        self._tasks = []
        if self._events is not None:
            self._events.close(linger=0)
            self._events = None
        for connector in self._connectors.values():
            connector.close()
        self._connectors = {}
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    # --- watching -------------------------------------------------------------------------------------------
    async def _event_loop(self, events: zmq.asyncio.Socket) -> None:
        # an exception here ends the task; _on_task_done turns that into a pipeline failure
        while True:
            self.on_event(await events.recv())

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        logger.error("orchestrator task %s ended", task.get_coro().__qualname__,
                     exc_info=(type(error), error, error.__traceback__) if error else None)
        self._pipeline_failed("orchestrator", f"{type(error).__name__}: {error}" if error else "task ended")

    # --- failure and recovery -------------------------------------------------------------------------------
    def _pipeline_failed(self, name: str, why: str) -> None:
        """The one place a failure lands: fail every in-flight request, then restart the pipeline. A pipeline that
        is still starting fails its start instead (start() raises, _recover retries)."""
        if self.closed or self._failed:
            return  # already failed (the other stage's exit, a late event) or shutting down
        loading = self.stages.get(name)
        if loading is not None and self._started and not loading.ready.done():
            # a talker loading on demand in a running pipeline: its load fails (`load` raises), nothing else
            loading.ready.set_exception(StageDeadError(f"stage {name} failed while loading: {why}"))
            return
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
        self.on_failure(error)
        self._recovery = asyncio.create_task(self._recover(name))

    async def _recover(self, name: str) -> None:
        async def start() -> None:
            self.restarts[name] += 1
            await self._start_pipeline()

        restarted = await self._restarts.restart(lambda: self._stop_pipeline(graceful=False), start,
                                                 f"stage {self.down} {self.down_reason}")
        if not restarted:
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            return
        self.down = self.down_reason = None
        logger.warning("pipeline restarted after stage %s failed (restart %d)", name, sum(self.restarts.values()))


def check_layout(layout: PipelineLayout, pipeline: PipelineConfig) -> None:
    """ValueError for several models in a layout that holds one: the fused one (both stages in one process), a TCP
    connector on a fixed port (each talker needs a connection of its own)."""
    if len(layout.talkers) == 1:
        return
    if pipeline.connector.kind == "local":
        raise ValueError("the fused layout (connector kind local) serves one model; serve several models with a "
                         "two-process layout (qwen3_tts_1gpu, cpu_tiny, ...)")
    if pipeline.connector.kind == "tcp" and pipeline.connector.tcp_port:
        raise ValueError(f"several models need a connector each: connector.tcp_port must be 0 (a free port each), "
                         f"got {pipeline.connector.tcp_port}")


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

