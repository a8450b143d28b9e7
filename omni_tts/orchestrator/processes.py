"""Stage processes, the pipeline's (supervisor.py) and the forced aligner's (aligner_client.py), supervised one way:
spawned with Ctrl+C held off (`spawn`), their Ready awaited within the load deadline (`wait_ready`), their exit seen
at once, with the reason they reported or how they ended (`StageWatch.watch_exit`), a ready one that sends no
heartbeat or stays in one step too long counted as hung (`StageWatch.hung`, watched by `watch_hangs`), and what failed
restarted with one backoff policy until it has restarted max_restarts times within restart_window (`Restarts`). The
timeouts and limits are SupervisionSettings'."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Awaitable, Callable, Iterable

from omni_tts.config import stage_environment
from omni_tts.config.settings import SupervisionSettings
from omni_tts.stages import bootstrap
from omni_tts.stages.common import HEARTBEAT_INTERVAL
from omni_tts.stages.messages import stage_kind

from .types import StageDeadError

logger = logging.getLogger(__name__)

# how long an exited stage's StageFailed may take to arrive: the stage sends it before exiting, but the exit can be
# seen first (process sentinel vs. the event socket)
FAILURE_REPORT_GRACE = 0.5


def spawn(target: Callable[..., None], args: tuple, name: str, stage: str) -> multiprocessing.Process:
    """Start the process of `stage`, which sets its environment (config.stage_environment) before it imports
    `target`'s module (stages/bootstrap.py). Ctrl+C signals the whole process group: blocked from the fork on (the
    mask outlives exec), a stage never sees it while it imports torch, before it ignores it itself (here it is
    delivered once restored)."""
    entry = f"{target.__module__}:{target.__qualname__}"
    process = multiprocessing.get_context("spawn").Process(
        target=bootstrap.run, args=(stage_environment(stage_kind(stage)), entry, *args), name=name, daemon=True)
    # a spawn starts Python's resource tracker first if it is not running, and unblocks SIGINT once it has: started
    # here, before the block
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return process


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass
class StageWatch:
    """One stage as its supervisor sees it: its process (the fused layout runs two stages in one), its Ready, the
    failure it reported (StageFailed) and its heartbeats."""
    name: str
    process: multiprocessing.Process
    ready: asyncio.Future = field(default_factory=_future)      # its pid, or why it did not start
    reported: asyncio.Future = field(default_factory=_future)   # the message of its StageFailed
    heartbeat_at: float = field(default_factory=time.monotonic)
    busy_seconds: float = 0.0
    connector_stalled_seconds: float = 0.0   # as of its last heartbeat (the talker's connector)
    pidfd: int | None = None                # while its exit is watched
    exit_wait: asyncio.Task | None = None   # after the process exited: waits for its report

    @property
    def serving(self) -> bool:
        """It reported Ready: it has loaded and runs its loop."""
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None

    def on_ready(self, pid: int) -> None:
        self.heartbeat_at = time.monotonic()
        if not self.ready.done():
            self.ready.set_result(pid)

    def on_heartbeat(self, busy_seconds: float, connector_stalled_seconds: float = 0.0) -> None:
        self.heartbeat_at, self.busy_seconds = time.monotonic(), busy_seconds
        self.connector_stalled_seconds = connector_stalled_seconds

    def on_failed(self, message: str) -> None:
        if not self.reported.done():
            self.reported.set_result(message)

    def hung(self, supervision: SupervisionSettings, now: float) -> str | None:
        """Why a ready stage counts as hung (it sends no heartbeat: stopped, or starved of CPU; or one step runs too
        long: deadlocked; or its connector has had no free slot too long: slots lost), else None. A loading one is
        bounded by the load deadline instead (`wait_ready`)."""
        if not self.ready.done():
            return None
        if now - self.heartbeat_at > supervision.heartbeat_timeout:
            return f"hung: no heartbeat for {now - self.heartbeat_at:.1f} s"
        if self.busy_seconds > supervision.step_timeout:
            return f"hung: one step has run for {self.busy_seconds:.0f} s"
        if self.connector_stalled_seconds > supervision.connector_stall_timeout:
            return f"hung: its connector has had no free slot for {self.connector_stalled_seconds:.0f} s"
        return None

    def watch_exit(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(why)` once the process has ended: the message of the StageFailed it sent before exiting,
        else how it ended. Watched through a pidfd, readable once the exit status is there to collect (the
        process's sentinel closes with its files, which a dying process that the scheduler preempts, niceness 10
        on a busy machine, can do well before: its status was not there yet)."""
        loop = asyncio.get_running_loop()

        def exited() -> None:
            self._close_pidfd()
            self.exit_wait = loop.create_task(self._report_exit(on_exit))
        self.pidfd = os.pidfd_open(self.process.pid)
        loop.add_reader(self.pidfd, exited)

    def unwatch(self) -> None:
        self._close_pidfd()
        if self.exit_wait is not None:
            self.exit_wait.cancel()

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            asyncio.get_running_loop().remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None

    async def _report_exit(self, on_exit: Callable[[str], None]) -> None:
        why = None
        if self.process.exitcode >= 0:  # killed by a signal, it reported nothing
            with contextlib.suppress(TimeoutError):
                why = await asyncio.wait_for(asyncio.shield(self.reported), FAILURE_REPORT_GRACE)
        on_exit(why or exit_description(self.process))


async def watch_hangs(stages: Callable[[], Iterable[StageWatch]], supervision: SupervisionSettings,
                      on_hung: Callable[[str, str], None]) -> None:
    """Every heartbeat interval, the ready stages of `stages()`: the first one that is hung goes to
    `on_hung(name, why)`, and the watch ends (what it watched is stopped and started again)."""
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL)
        now = time.monotonic()
        for stage in stages():
            why = stage.hung(supervision, now)
            if why is not None:
                on_hung(stage.name, why)
                return


async def wait_ready(stages: list[StageWatch], timeout: float) -> None:
    """Returns once every stage reported Ready; raises the first one's failure to start, and StageDeadError past the
    load deadline `timeout` (a stage that hangs while loading)."""
    done, pending = await asyncio.wait([s.ready for s in stages], timeout=timeout,
                                       return_when=asyncio.FIRST_EXCEPTION)
    for ready in done:
        ready.result()  # a stage failed to start (wait_for(gather()), cancelled, would log an unretrieved error)
    if pending:
        late = ", ".join(s.name for s in stages if s.ready in pending)
        raise StageDeadError(f"stage {late} was not ready within {timeout:g} s")


class Restarts:
    """When what failed (the pipeline, the aligner) starts again: at once, then after 1, 2, 4, … s while its starts
    fail (SupervisionSettings.backoff); never again once it has restarted max_restarts times within restart_window
    (`fatal` then says why)."""

    def __init__(self, what: str, supervision: SupervisionSettings) -> None:
        self.what, self.supervision = what, supervision
        self.fatal: str | None = None
        self._times: collections.deque[float] = collections.deque()

    async def restart(self, stop: Callable[[], Awaitable[None]], start: Callable[[], Awaitable[None]],
                      failure: str) -> bool:
        """Stop it and start it again until a start succeeds (True) or the restarts are spent (False). failure:
        why it failed, for `fatal`."""
        failed_starts = 0
        while True:
            await stop()
            now, window = time.monotonic(), self.supervision.restart_window
            while self._times and now - self._times[0] > window:
                self._times.popleft()
            if len(self._times) >= self.supervision.max_restarts:
                self.fatal = f"{len(self._times)} restarts within {window:.0f} s; last: {failure}"
                logger.critical("giving up on the %s: %s", self.what, self.fatal)
                return False
            await asyncio.sleep(self.supervision.backoff(failed_starts))
            self._times.append(time.monotonic())
            try:
                await start()
                return True
            except Exception as e:  # noqa: BLE001 — any start failure is retried, then given up on
                logger.error("%s restart failed: %s: %s", self.what, type(e).__name__, e)
                failed_starts += 1


def exit_description(process: multiprocessing.Process) -> str:
    """How a stage process ended (its exit status collected), for a failure reason: `exited with status N`,
    `killed by signal SIGKILL`."""
    code = process.exitcode
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def stop_process(process: multiprocessing.Process) -> None:
    process.join(5)
    if process.is_alive():
        process.terminate()
        process.join(3)
    if process.is_alive():
        process.kill()
        process.join()
