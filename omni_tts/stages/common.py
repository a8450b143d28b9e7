"""What both stage processes share: the control inbox thread and the process main wrapper."""
from __future__ import annotations

import collections
import logging
import os
import threading
import traceback
from typing import Callable

import msgspec
import zmq

from omni_tts.config.threads import set_torch_threads

from .protocol import StageCommand, StageEvent, StageFailed, StageLaunch

_command_decoder = msgspec.msgpack.Decoder(StageCommand)
# compute-bound CPU stages yield to the API process, whose event loop must answer in milliseconds; the talker yields
# to code2wav too: frames already generated are closer to a listener than new ones, and the talker runs ahead of
# real time, so when the cores are short the pipeline drains before it fills
CPU_STAGE_NICENESS = {"talker": 8, "code2wav": 5}


class StageIO:
    """Control messages in (a thread blocked in zmq recv appends to an inbox and notifies `condition`),
    events out (a PUSH socket used only by the stage's main thread)."""

    def __init__(self, launch: StageLaunch, condition: threading.Condition) -> None:
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
            with self.condition:
                self.inbox.append(message)
                self.condition.notify_all()

    def take_commands(self) -> list:
        with self.condition:
            messages = list(self.inbox)
            self.inbox.clear()
            return messages

    def send(self, event: StageEvent) -> None:
        self.events.send(self.encoder.encode(event))

    def close(self) -> None:
        """Flush and close the event socket; the control thread dies with the process (see run_stage)."""
        self.events.close(linger=1000)


def run_stage(launch_bytes: bytes, main: Callable[[StageLaunch], None]) -> None:
    """Process entry: decode the launch struct, run `main`, report a crash as StageFailed before dying."""
    launch = msgspec.msgpack.decode(launch_bytes, type=StageLaunch)
    # a spawned process inherits no logging config; as the CLI: warnings, and omni_tts at INFO
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("omni_tts").setLevel(logging.INFO)
    if launch.device == "cpu":
        os.nice(CPU_STAGE_NICENESS[launch.stage])
    set_torch_threads(launch.threads)
    try:
        main(launch)
        # exit without interpreter teardown: the control thread is blocked in zmq recv, and terminating its
        # context from here would wait for it (or trip zmq's assertions)
        os._exit(0)
    except BaseException:
        error = traceback.format_exc()
        try:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(launch.event_address)
            sock.send(msgspec.msgpack.encode(StageFailed(launch.stage, error)))
            sock.close()
        finally:
            os._exit(1)
