"""What the stage processes share: the control inbox thread, the heartbeat thread and the process main wrapper
(the aligner stage takes `name_process`, `fail_process` and the heartbeats, `start_heartbeats`).

Failure model: any exception in the main loop or in a helper thread (control, connector) ends the process after a
StageFailed event; the orchestrator restarts the pipeline. A stopped or stuck process is caught by its heartbeats
(the orchestrator kills it). A stage whose parent died cleans up what the parent owned and exits.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
import traceback
from typing import Callable

import msgspec
import zmq

from omni_tts.config.threads import set_torch_threads
from omni_tts.connectors.base import ChunkWriterBase
from omni_tts.connectors.shm_ring import cleanup_stale_blocks
from omni_tts.log import configure_logging

from .messages import AlignerLaunch, Heartbeat, StageCommand, StageEvent, StageFailed, StageLaunch, stage_kind

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.5  # seconds; the orchestrator's timeout is several of these

_command_decoder = msgspec.msgpack.Decoder(StageCommand)
# compute-bound CPU stages yield to the API process, whose event loop must answer in milliseconds; the talker yields
# to code2wav too: frames already generated are closer to a listener than new ones, and the talker runs ahead of
# real time, so when the cores are short the pipeline drains before it fills
CPU_STAGE_NICENESS = {"talker": 8, "code2wav": 5}


class ThreadFailed(Exception):
    """A helper thread of the stage died; put in the inbox so the main loop raises it (and the stage fails)."""


class LoopClock:
    """When the main loop's current iteration began (None while it waits for work), read by the heartbeat thread."""

    def __init__(self) -> None:
        self.busy_since: float | None = None
        self.writer: ChunkWriterBase | None = None   # the talker's connector end, whose stalls heartbeats report

    def busy_seconds(self) -> float:
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since


LOOP_CLOCKS: dict[str, LoopClock] = {}  # by stage: the fused layout runs two stages' loops in one process


class StageIO:
    """Control messages in (a thread blocked in zmq recv appends to an inbox and notifies `condition`),
    events out (a PUSH socket used only by the stage's main thread)."""

    def __init__(self, launch: StageLaunch, condition: threading.Condition) -> None:
        self.stage = launch.stage
        self.clock = LOOP_CLOCKS.setdefault(launch.stage, LoopClock())
        self.condition = condition
        self.inbox: collections.deque = collections.deque()
        self.ctx = zmq.Context(io_threads=1)
        self.commands = self.ctx.socket(zmq.PULL)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.bind(launch.command_address)
        self.events = self.ctx.socket(zmq.PUSH)
        self.events.setsockopt(zmq.LINGER, 1000)
        self.events.connect(launch.event_address)
        self.encoder = msgspec.msgpack.Encoder()
        threading.Thread(target=self._recv_loop, name=f"omni-tts-{launch.stage}-control", daemon=True).start()

    def _recv_loop(self) -> None:
        while True:
            try:
                message = _command_decoder.decode(self.commands.recv())
            except zmq.ZMQError:
                return
            except BaseException as e:  # an undecodable command: the stage fails rather than drop it silently
                self.thread_failed("control", e)
                return
            with self.condition:
                self.inbox.append(message)
                self.condition.notify_all()

    def thread_failed(self, thread: str, error: BaseException) -> None:
        """Called by a dying helper thread: the main loop wakes and raises ThreadFailed."""
        with self.condition:
            self.inbox.append(ThreadFailed(f"{self.stage} {thread} thread failed: {type(error).__name__}: {error}"))
            self.condition.notify_all()

    def wait(self, has_work: Callable[[], bool]) -> None:
        """Block until a command arrives or `has_work()`; the loop counts as busy from the return on."""
        self.clock.busy_since = None
        with self.condition:
            self.condition.wait_for(lambda: self.inbox or has_work())
        self.clock.busy_since = time.monotonic()

    def take_commands(self) -> list:
        with self.condition:
            messages = list(self.inbox)
            self.inbox.clear()
        for message in messages:
            if isinstance(message, ThreadFailed):
                raise message
        return messages

    def send(self, event: StageEvent) -> None:
        self.events.send(self.encoder.encode(event))

    def close(self) -> None:
        """Flush and close the event socket; the control thread dies with the process (see run_stage)."""
        self.events.close(linger=1000)


def run_stage(launch_bytes: bytes, main: Callable[[StageLaunch], None]) -> None:
    """Process entry of one stage: decode the launch struct, run `main`, report a crash as StageFailed before dying."""
    run_stages((launch_bytes,), lambda launches: main(launches[0]))


def run_stages(launches_bytes: tuple[bytes, ...], main: Callable[[list[StageLaunch]], None]) -> None:
    """Process entry of the stages in `launches_bytes` (two in the fused layout): one heartbeat thread for all, `main`
    on this thread; a crash is reported as the first stage's (a stage that runs on another thread reports its own,
    `fail_process`). torch's intra-op thread count is the process's, and every loop's ops use it while the loops run
    at once, so the process takes the largest stage share, not the sum, which oversubscribes the cores
    (docs/benchmarks.md, "The fused process's torch threads")."""
    # Ctrl+C in a terminal signals the whole process group; the server stops its stages itself (Shutdown). The
    # server spawned this process with SIGINT blocked, so none arrived before now: ignored, it can be unblocked
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    launches = [msgspec.msgpack.decode(b, type=StageLaunch) for b in launches_bytes]
    name_process("omni-tts-" + (launches[0].stage if len(launches) == 1 else "fused"))
    configure_logging(launches[0].log_level)  # a spawned process inherits no logging config
    cpu_stages = [launch.stage for launch in launches if launch.config.device == "cpu"]
    if cpu_stages:
        os.nice(min(CPU_STAGE_NICENESS[stage_kind(stage)] for stage in cpu_stages))
    set_torch_threads(max(launch.threads for launch in launches))
    start_heartbeats(launches)
    try:
        main(launches)
        # exit without interpreter teardown: the control thread is blocked in zmq recv, and terminating its
        # context from here would wait for it (or trip zmq's assertions)
        os._exit(0)
    except BaseException as e:
        fail_process(launches[0], e)


def fail_process(launch: StageLaunch, error: BaseException) -> None:
    """`launch`'s stage failed with `error` (being handled): report it, then end the process (every stage in it)."""
    try:
        _report_failure(launch, StageFailed(launch.stage, traceback.format_exc(), f"{type(error).__name__}: {error}"))
    finally:
        os._exit(1)


def _report_failure(launch: StageLaunch, failed: StageFailed) -> None:
    """Send StageFailed and wait (up to a second) until it has left: os._exit right after a send would drop the
    queued message, and the orchestrator would only see the process exit, not why."""
    ctx = zmq.Context()  # its own: term() waits for this socket only, not the control thread's blocked recv
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(launch.event_address)
    sock.send(msgspec.msgpack.encode(failed))
    sock.close()
    ctx.term()


def name_process(name: str) -> None:
    """What ps/top show for this process (Linux; 15 characters), so an operator can tell the stages apart."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def start_heartbeats(launches: list[StageLaunch] | list[AlignerLaunch]) -> None:
    """Heartbeats of the stages in `launches` (this process's) from a thread of their own, from now on; each stage's
    loading counts as busy (its supervisor waits for Ready first)."""
    for launch in launches:
        LOOP_CLOCKS.setdefault(launch.stage, LoopClock()).busy_since = time.monotonic()
    threading.Thread(target=_heartbeat_loop, args=(launches, os.getppid()), name="omni-tts-heartbeat",
                     daemon=True).start()


def _heartbeat_loop(launches: list[StageLaunch] | list[AlignerLaunch], parent_pid: int) -> None:
    """Heartbeats of every stage in the process, on a socket of its own (zmq sockets are single-threaded); exits the
    process when the parent dies, after removing the parent's shared memory and ipc files (nobody else is left to)."""
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4 * len(launches))  # a parent that stopped reading must not grow our memory
    sock.connect(launches[0].event_address)
    encoder = msgspec.msgpack.Encoder()
    while True:
        if os.getppid() != parent_pid:
            logger.error("%s: the server process %d is gone; exiting", launches[0].stage, parent_pid)
            cleanup_stale_blocks()
            os._exit(1)
        for launch in launches:
            try:
                clock = LOOP_CLOCKS[launch.stage]
                stalled = 0.0 if clock.writer is None else clock.writer.stats().stalled_seconds
                sock.send(encoder.encode(Heartbeat(launch.stage, clock.busy_seconds(), stalled)), zmq.NOBLOCK)
            except zmq.Again:
                pass
        time.sleep(HEARTBEAT_INTERVAL)
