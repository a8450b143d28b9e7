"""Stage 1 process: chunks from the connector → batched streaming decode → audio to the orchestrator."""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import torch

from omni_tts.connectors.kinds import chunk_reader
from omni_tts.engine.code2wav_engine import CodecChunk, Code2WavEngine, measure_frame_budget
from omni_tts.models.qwen3_tts.model import Qwen3TTS

from .common import StageIO, run_stage
from .protocol import (CONNECTOR_SECONDS_BUCKETS, STEP_SECONDS_BUCKETS, Abort, AudioChunk, DurationHistogram, GetStats,
                       Ready, Register, Shutdown, StageLaunch, StageStats)

logger = logging.getLogger(__name__)

class Code2WavStage:
    def __init__(self, launch: StageLaunch) -> None:
        tts = Qwen3TTS(launch.model_dir, device=launch.device, dtype=getattr(torch, launch.dtype), with_talker=False)
        max_frames = launch.max_frames_per_step
        if max_frames is None:
            max_frames = measure_frame_budget(tts.decoder, launch.chunk_frames, launch.max_batch_size)
        logger.info("code2wav: %d frames per decoder call (%s), %d lane(s)", max_frames,
                    "measured" if launch.max_frames_per_step is None else "configured", launch.lanes)
        self.engine = Code2WavEngine(tts.decoder, launch.max_batch_size, max_frames, launch.lanes)
        self.condition = threading.Condition()
        self.io = StageIO(launch, self.condition)
        self.reader = chunk_reader(launch.connector, condition=self.condition,  # arrivals wake the same loop
                                   on_error=lambda e: self.io.thread_failed("connector", e))
        self.step_durations = DurationHistogram.empty(STEP_SECONDS_BUCKETS)
        self.connector_latencies = DurationHistogram.empty(CONNECTOR_SECONDS_BUCKETS)
        self.num_chunks = 0
        self.num_unknown_chunks = 0

    def run(self) -> None:
        self.reader.start()
        self.io.send(Ready("code2wav", os.getpid()))
        while True:
            self.io.wait(lambda: self.reader.stats().queued > 0 or self.engine.has_work())
            for message in self.io.take_commands():
                if isinstance(message, Shutdown):
                    self.reader.close()
                    self.io.close()
                    return
                self._handle(message)
            now = time.monotonic_ns()
            for chunk in self.reader.get_all_nowait():
                self.connector_latencies.observe((now - chunk.put_ns) / 1e9)
                self.num_chunks += 1
                rid = chunk.request_id
                if rid not in self.engine.requests:
                    # aborted (its last chunks were in flight), or no request of ours: no state for it. The
                    # orchestrator sends Register before the talker gets the request, so it is here first.
                    self.num_unknown_chunks += 1
                    logger.debug("chunk %d of unknown request %r dropped", chunk.seq, rid)
                else:
                    try:
                        self.engine.add_chunk(rid, CodecChunk(np.array(chunk.codes), chunk.is_last, chunk.is_context))
                    except ValueError as e:
                        # which chunk and of what kind (reference codes or generated frames) says where to look
                        where = f"chunk {chunk.seq} ({'reference context' if chunk.is_context else 'generated'})"
                        logger.error("request %s: %s refused: %s: %s", rid, where, e, np.array(chunk.codes).tolist())
                        self.engine.abort(rid)
                        error = f"code2wav cannot decode its codes: {where}: {e}"
                        self.io.send(AudioChunk(rid, b"", True, error=error))
                self.reader.release(chunk)
            if self.engine.has_work():
                started = time.perf_counter()
                outputs = self.engine.step()
                self.step_durations.observe(time.perf_counter() - started)
                for out in outputs:
                    self.io.send(AudioChunk(out.request_id, out.audio.astype(np.float32).tobytes(), out.finished))

    def _handle(self, message: object) -> None:
        if isinstance(message, Register):
            self.engine.add_request(message.request_id)
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id)
        elif isinstance(message, GetStats):
            self.io.send(StageStats("code2wav", os.getpid(), list(self.engine.requests), self.engine.num_steps,
                                    time.process_time(), self.step_durations, self.num_chunks,
                                    self.connector_latencies, self.num_unknown_chunks))


def main(launch_bytes: bytes) -> None:
    run_stage(launch_bytes, lambda launch: Code2WavStage(launch).run())
