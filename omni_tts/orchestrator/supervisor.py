"""The process supervisor: starts the pipeline (connector, control sockets, both stage processes), watches it, and
restarts it when a stage fails.

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
from omni_tts.stages.messages import AlignerLaunch, Heartbeat, Shutdown, StageLaunch

from .processes import Restarts, StageWatch, spawn, stop_process, wait_ready, watch_hangs
from .types import EngineShutDown, StageDeadError

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StageProcess(StageWatch):
    command: zmq.asyncio.Socket   # the stage's control socket


class StageSupervisor:
    def __init__(self, model_dir: str, pipeline: PipelineConfig, num_code_groups: int,
                 on_event: Callable[[bytes], None], on_failure: Callable[[StageDeadError], None],
                 supervision: SupervisionSettings, cpus: int | None = None) -> None:
        """on_event: each frame the stages send (run in the event task: an exception there fails the pipeline);
        on_failure: the pipeline failed, every request in it fails with this error. cpus: the cores the CPU
        stages' threads share (default: those this process may run on)."""
        self.model_dir, self.pipeline, self.num_code_groups = model_dir, pipeline, num_code_groups
        self.on_event, self.on_failure = on_event, on_failure
        self.supervision = supervision
        check_devices(pipeline)
        self.threads = stage_threads(pipeline, cpus)
        talker, code2wav = pipeline.stages.talker, pipeline.stages.code2wav
        # requests each stage runs together: the talker is also bounded by its KV cache rows
        self.batch_sizes = {"talker": min(talker.max_batch_size, talker.num_cache_rows),
                            "code2wav": code2wav.max_batch_size}
        self.stages: dict[str, StageProcess] = {}
        self.hosted_aligner: AlignerLaunch | None = None   # the forced aligner code2wav's process runs beside it
        self.epoch = 0                      # counts pipeline starts: a request belongs to the one it entered
        self.down: str | None = None        # the stage (or "orchestrator") whose failure is being recovered from
        self.down_reason: str | None = None
        self.restarts: collections.Counter[str] = collections.Counter()  # by the stage that failed
        self.on_fatal: Callable[[str], None] | None = None   # called once on giving up
        self.closed = False
        self._failed = False                # this pipeline has failed (start() or _recover handles a starting one)
        self._restarts = Restarts("pipeline", supervision)
        self._connector: ConnectorOwner | None = None
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []    # this pipeline's event and watchdog tasks
        self._recovery: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()

    # --- what the pipeline is now ---------------------------------------------------------------------------
    @property
    def connector_spec(self) -> ConnectorSpec | None:
        """The running pipeline's chunk connector (what the stages attach to)."""
        return self._connector.spec if self._connector is not None else None

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
        """Send a command to a stage of pipeline `epoch`; StageDeadError once that pipeline is gone."""
        if self.closed:
            raise EngineShutDown("the engine is shut down")
        if epoch != self.epoch:
            raise StageDeadError(f"stage {self.down or 'pipeline'} is restarting")
        try:
            await self.stages[stage].command.send(frame)
        except zmq.ZMQError:  # the pipeline was torn down meanwhile
            raise StageDeadError(f"stage {self.down or 'pipeline'} is restarting") from None

    # --- what the stages report (decoded by the stage client) -------------------------------------------------
    def on_ready(self, name: str, pid: int) -> None:
        self.stages[name].on_ready(pid)

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.stages[heartbeat.stage].on_heartbeat(heartbeat.busy_seconds, heartbeat.connector_stalled_seconds)

    def on_stage_failed(self, name: str, message: str, traceback: str) -> None:
        stage = self.stages[name]
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
        """Connector, control sockets and the stage processes (one in the fused layout); returns when both stages
        are ready."""
        conn = self.pipeline.connector
        self._failed = False
        self.epoch += 1
        self._connector = create_owner(conn, self.num_code_groups)
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
        launches = {name: self._launch(name, f"ipc://{self._ipc_dir}/{name}") for name in ("talker", "code2wav")}
        # the fused layout (connector kind local) runs both stages in one process
        processes = ([("fused", fused_stage.main, ("talker", "code2wav"))] if conn.kind == "local" else
                     [("talker", talker_stage.main, ("talker",)), ("code2wav", code2wav_stage.main, ("code2wav",))])
        for process_name, entry, names in processes:
            process = spawn(entry, tuple(msgspec.msgpack.encode(launches[n]) for n in names),
                            f"omni-tts-{process_name}", names[0])
            for name in names:
                command = self._ctx.socket(zmq.PUSH)
                command.setsockopt(zmq.LINGER, 0)
                command.connect(launches[name].command_address)
                self.stages[name] = StageProcess(name=name, process=process, command=command)
            # a process's exit is watched once; a stage that failed names itself in its StageFailed
            first = self.stages[names[0]]
            first.watch_exit(lambda why, name=first.name: self._pipeline_failed(name, why))
        await wait_ready(list(self.stages.values()), self.supervision.startup_timeout)

    def _launch(self, name: str, command_address: str) -> StageLaunch:
        """What stage `name`'s process needs to run it in the pipeline being started."""
        return StageLaunch(stage=name, model_dir=self.model_dir, pipeline=self.pipeline,
                           max_batch_size=self.batch_sizes[name], threads=self.threads[name],
                           command_address=command_address, event_address=self.event_address,
                           connector=self._connector.spec,
                           lanes=code2wav_lanes(self.pipeline, self.threads) if name == "code2wav" else 1,
                           log_level=logging.getLogger("omni_tts").getEffectiveLevel(),
                           aligner=self.hosted_aligner if name == "code2wav" else None)

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
        if self._connector is not None:
            self._connector.close()
            self._connector = None
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

