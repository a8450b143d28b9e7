"""The forced-aligner stage seen from the API process: spawn it, ask it for word times, restart it when it dies or
hangs.

It is supervised apart from the TTS pipeline, the same way (processes.py): the aligner is off the audio path, so its
failure never fails a request. It sends heartbeats as the stages do; one that exits, or sends none for the stages'
heartbeat timeout (stopped, starved) or stays in one step past their step timeout, is killed if need be and started
again after the pipeline's backoff, within the same load deadline, and given up on after as many restarts.
Alignments in flight then (or that wait past `timeout_s`) end in `AlignerUnavailable`, which a response turns into
`timestamps: null` with the reason; a span nobody waits for any more is dropped from the stage's queue.
With placement `code2wav` the aligner is a thread of code2wav's process (the supervisor passes it `launch`): this
client then watches that process (a pidfd) instead of spawning one, and the aligner comes back with the pipeline.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from omni_tts.config.settings import SupervisionSettings
from omni_tts.config.stage_config import AlignerStageConfig
from omni_tts.stages import aligner_stage
from omni_tts.stages.messages import (
    Abort,
    AlignerEvent,
    AlignerLaunch,
    AlignSpan,
    DropSpan,
    Heartbeat,
    Ready,
    SpanAligned,
    Shutdown,
    StageFailed,
)

from .processes import Restarts, StageWatch, spawn, stop_process, wait_ready, watch_hangs

logger = logging.getLogger(__name__)


WordTimes = list[tuple[str, int, int]]   # (word, start_ms, end_ms), in text order


class AlignerUnavailable(Exception):
    """No word times for this span: the message says why (stage down, restarting, timed out, failed)."""


class AlignerClient:
    def __init__(self, model_dir: str, config: AlignerStageConfig, supervision: SupervisionSettings) -> None:
        """Sockets and processes come at start(); `launch` (the addresses) is there at once, for a pipeline that
        hosts the aligner and starts before it."""
        self.model_dir, self.config, self.supervision = model_dir, config, supervision
        self._ctx: zmq.asyncio.Context | None = None
        self._events: zmq.asyncio.Socket | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix=f"omni_tts_{os.getpid()}_aligner_")
        self._events_address = f"ipc://{self._ipc_dir}/events"
        self._command: zmq.asyncio.Socket | None = None
        self._stage: StageWatch | None = None       # its own process (placement process)
        self._hang_watch: asyncio.Task | None = None
        self._restarts = Restarts("forced aligner", supervision)
        self._recovery: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None    # hosted: Ready from code2wav's thread
        self._pending: dict[tuple[str, int], asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.closed = False
        self.down_reason: str | None = "the aligner stage is starting"
        self.hosted = config.placement == "code2wav"
        self._host: tuple[int, int] | None = None   # hosted: (pid, pidfd) of code2wav's process
        self.launch = AlignerLaunch(stage="aligner", model_dir=model_dir, device=config.device, dtype=config.dtype,
                                    threads=config.threads, max_batch_size=config.max_batch_size,
                                    command_address=f"ipc://{self._ipc_dir}/commands",
                                    event_address=self._events_address,
                                    log_level=logging.getLogger("omni_tts").getEffectiveLevel())

    def status(self) -> dict:
        """For /health: whether it aligns now (else why not), its process and the spans it owes."""
        pid = self._host[0] if self._host else self._stage.process.pid if self._stage is not None else None
        return {"ready": self.down_reason is None, "reason": self.down_reason, "placement": self.config.placement,
                "pid": pid, "pending": len(self._pending)}

    async def start(self) -> None:
        """Start the stage (hosted: wait for code2wav's thread, which the pipeline started); raises if it cannot load
        (a bad checkpoint is the operator's error, found at start)."""
        self._ctx = zmq.asyncio.Context()
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(self._events_address)   # a hosted aligner's Ready waits in its PUSH until this bind
        if self.hosted:
            self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_events())
        if not self.hosted:
            await self._spawn()
            return
        self._connect()
        await asyncio.wait_for(asyncio.shield(self._ready), self.supervision.startup_timeout)

    async def align(self, request_id: str, span: int, audio: np.ndarray, sample_rate: int, text: str,
                    language: str | None) -> WordTimes:
        """Word times of one finished piece of audio (float32 mono), relative to its start."""
        if self.down_reason is not None:
            raise AlignerUnavailable(self.down_reason)
        key = (request_id, span)
        future = self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            await self._command.send(msgspec.msgpack.encode(AlignSpan(
                request_id, span, text, language, np.ascontiguousarray(audio, dtype=np.float32).tobytes(),
                sample_rate)))
            return await asyncio.wait_for(future, self.config.timeout_s)
        except asyncio.TimeoutError:
            raise AlignerUnavailable(f"the aligner did not answer within {self.config.timeout_s:g} s") from None
        finally:
            self._pending.pop(key, None)
            if future.cancelled() or not future.done():   # timed out (wait_for cancels it), or the caller gave up
                self._drop(key)

    async def abort(self, request_id: str) -> None:
        """Drop the request's spans that wait in the stage (a client that left needs none)."""
        if self._command is not None and self.down_reason is None:
            await self._command.send(msgspec.msgpack.encode(Abort(request_id)))

    def _drop(self, key: tuple[str, int]) -> None:
        """The stage skips span `key` if it has not aligned it yet. Never waits: a stage that reads no commands
        (stopped) has a full queue, and then it gets nothing, which its restart drops anyway."""
        if self._command is None or self.down_reason is not None:
            return
        with contextlib.suppress(zmq.Again):
            zmq.Socket.shadow(self._command.underlying).send(msgspec.msgpack.encode(DropSpan(*key)), zmq.NOBLOCK)

    async def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in (self._recovery, self._reader, self._hang_watch):
            if task is not None:
                task.cancel()
        self._unwatch_host()
        if self._stage is not None:
            if self._stage.process.is_alive() and self._command is not None:
                await self._command.send(msgspec.msgpack.encode(Shutdown()))
                await asyncio.to_thread(self._stage.process.join, 5)
            self._stage.unwatch()
            stop_process(self._stage.process)
        self._fail_pending("the server is shutting down")
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def _spawn(self) -> None:
        """Start the aligner's process; returns once it has loaded, raises if it fails to or hangs past the load
        deadline."""
        process = spawn(aligner_stage.main, (msgspec.msgpack.encode(self.launch),), "omni-tts-aligner", "aligner")
        self._connect()
        self._stage = StageWatch("aligner", process)
        self._stage.watch_exit(self._on_exit)
        await wait_ready([self._stage], self.supervision.startup_timeout)
        self._hang_watch = asyncio.create_task(watch_hangs(lambda: [self._stage], self.supervision, self._on_hung))
        self.down_reason = None
        logger.info("forced aligner ready (pid %d, %s)", process.pid, self.config.device)

    async def _stop(self) -> None:
        """Its process ended (killed if need be: one that hangs while loading, or is stopped, reads no command)."""
        self._unwatch()
        if self._stage.process.is_alive():
            self._stage.process.kill()
        await asyncio.to_thread(stop_process, self._stage.process)

    def _connect(self) -> None:
        if self._command is not None:
            self._command.close(linger=0)
        self._command = self._ctx.socket(zmq.PUSH)
        self._command.setsockopt(zmq.LINGER, 0)
        self._command.connect(self.launch.command_address)

    def _watch_host(self, pid: int) -> None:
        """Hosted: the aligner thread of code2wav's process `pid` is ready; that process's exit is watched."""
        self._unwatch_host()
        fd = os.pidfd_open(pid)
        self._host = (pid, fd)
        asyncio.get_running_loop().add_reader(fd, self._on_host_exit)
        self.down_reason = None
        logger.info("forced aligner ready (a thread of code2wav's process %d, %s)", pid, self.config.device)

    def _unwatch_host(self) -> None:
        if self._host is not None:
            asyncio.get_running_loop().remove_reader(self._host[1])
            os.close(self._host[1])
            self._host = None

    def _on_host_exit(self) -> None:
        pid = self._host[0]
        self._unwatch_host()
        self.down_reason = (f"code2wav's process {pid}, which runs the aligner, exited; the aligner comes back when "
                            "the pipeline restarts")
        self._fail_pending(self.down_reason)

    async def _read_events(self) -> None:
        decoder = msgspec.msgpack.Decoder(AlignerEvent)
        while True:
            event = decoder.decode(await self._events.recv())
            if isinstance(event, SpanAligned):
                future = self._pending.get((event.request_id, event.span))
                if future is not None and not future.done():
                    if event.error is None:
                        future.set_result(list(event.words))
                    else:
                        future.set_exception(AlignerUnavailable(event.error))
            elif isinstance(event, Heartbeat):
                self._stage.on_heartbeat(event.busy_seconds)   # only its own process sends them
            elif isinstance(event, Ready):
                if not self.hosted:
                    self._stage.on_ready(event.pid)
                    continue
                if not self._ready.done():
                    self._ready.set_result(event.pid)
                self._watch_host(event.pid)
            elif isinstance(event, StageFailed):
                logger.error("forced aligner stage failed: %s\n%s", event.message, event.error)
                if not self.hosted:
                    self._stage.on_failed(event.message)   # its exit follows
                    continue
                # the thread ended; code2wav's process goes on
                self.down_reason = f"the aligner failed ({event.message})"
                self._fail_pending(self.down_reason)
                if not self._ready.done():
                    self._ready.set_exception(RuntimeError(f"the forced aligner did not load: {event.message}"))

    def _on_exit(self, why: str) -> None:
        ready = self._stage.ready
        if not ready.done():  # it died while loading: its start fails (start() raises it, a restart retries)
            ready.set_exception(RuntimeError(f"the forced aligner stage exited while loading: {why}"))
            ready.exception()  # retrieved: a start past its deadline waits no more
            return
        self._stage_failed(f"exited ({why})")

    def _on_hung(self, _: str, why: str) -> None:
        self._stage_failed(f"is {why}")

    def _stage_failed(self, what: str) -> None:
        """It exited or hangs (`what` it did): what it owes ends with the reason, and it is stopped and started
        again; its other watch is dropped, so a failure is handled once."""
        if self.closed:
            return
        self._unwatch()
        self.down_reason = f"the aligner stage {what}; it is restarting"
        logger.error("forced aligner stage %s: pending alignments get no timestamps; restarting", what)
        self._fail_pending(self.down_reason)
        self._recovery = asyncio.create_task(self._recover(what))

    async def _recover(self, what: str) -> None:
        if not await self._restarts.restart(self._stop, self._spawn, f"the aligner stage {what}"):
            self.down_reason = f"the aligner failed for good: {self._restarts.fatal}"

    def _unwatch(self) -> None:
        self._stage.unwatch()
        if self._hang_watch is not None:
            self._hang_watch.cancel()

    def _fail_pending(self, reason: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(AlignerUnavailable(reason))
