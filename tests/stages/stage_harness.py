"""A real TalkerStage in this process (its run() on a thread, with its real sockets and ring), for the stage tests."""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import zmq

from conftest import FIXTURES
from omni_tts.config import Code2WavStageConfig, PipelineConfig, StagesConfig, TalkerStageConfig
from omni_tts.connectors.shm_ring import ChunkReader, RingOwner
from omni_tts.stages.messages import GetStats, Shutdown, StageEvent, StageLaunch, StageStats
from omni_tts.stages.talker_stage import TalkerStage


@dataclass
class StepLog:
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)   # frames the step made (one per running stream)


class StageHarness:
    """TalkerStage.run() on a thread, with its real sockets and ring; records every engine step's start and end."""

    def __init__(self, threads: int = 1, model_dir: Path = FIXTURES / "tiny-base",
                 talker: TalkerStageConfig = TalkerStageConfig(device="cpu"), loras: dict[str, str] | None = None
                 ) -> None:
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)  # as a CPU stage runs
        self.ring = RingOwner.create(64, 25)
        self.dir = tempfile.mkdtemp(prefix="vf_")
        self.ctx = zmq.Context()
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(f"ipc://{self.dir}/events")
        pipeline = PipelineConfig(stages=StagesConfig(talker=talker, code2wav=Code2WavStageConfig(device="cpu")))
        launch = StageLaunch(stage="talker", model_dir=str(model_dir), pipeline=pipeline, max_batch_size=8,
                             threads=threads, command_address=f"ipc://{self.dir}/talker",
                             event_address=f"ipc://{self.dir}/events", connector=self.ring.spec, loras=loras or {})
        self.reader = ChunkReader(self.ring.spec)
        self.reader.start()
        self.stage = TalkerStage(launch)
        self.log = StepLog()
        step = self.stage.engine.step

        def timed_step():
            self.log.starts.append(time.perf_counter())
            outputs = step()
            self.log.frames.append(sum(out.frame is not None for out in outputs))
            self.log.ends.append(time.perf_counter())
            return outputs

        self.stage.engine.step = timed_step
        self.chunks: list[tuple[str, int, bool, bool]] = []   # (request id, seq, is_context, is_last) as they come
        self.other_events: list = []
        threading.Thread(target=self._read_ring, daemon=True).start()
        self.thread = threading.Thread(target=self.stage.run, daemon=True)
        self.thread.start()
        self.commands = self.ctx.socket(zmq.PUSH)
        self.commands.connect(launch.command_address)
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StageEvent)
        self.next_event(StageEvent)  # Ready

    def _read_ring(self) -> None:
        while (chunk := self.reader.get()) is not None:
            self.chunks.append((chunk.request_id, chunk.seq, chunk.is_context, chunk.is_last))
            self.reader.release(chunk)

    def send(self, message) -> None:
        self.commands.send(self.encoder.encode(message))

    def next_event(self, kind: type, timeout: float = 30.0):
        """The next event of `kind`; others are kept in `other_events`."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.events.poll(max(0.0, deadline - time.monotonic()) * 1000), f"no {kind} within {timeout} s"
            event = self.decoder.decode(self.events.recv())
            if isinstance(event, kind):
                return event
            self.other_events.append(event)

    def received(self, request_id: str) -> list[tuple[int, bool, bool]]:
        return [(seq, ctx, last) for rid, seq, ctx, last in self.chunks if rid == request_id]

    def stats(self) -> StageStats:
        self.send(GetStats())
        return self.next_event(StageStats)

    def close(self) -> None:
        self.send(Shutdown())
        self.thread.join(10)
        self.reader.close()
        self.ctx.destroy(linger=0)
        self.ring.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        torch.set_num_threads(self.threads_before)
