"""Stage 1 process: chunks from the connector → batched streaming decode → audio to the orchestrator.

A request's decoder state exists only from its Register (a control message from the orchestrator) to its last chunk
or its abort; a chunk never creates one. Register is sent before the talker gets the request, but on another
socket, so under load a request's first chunks can arrive first: they wait for it (their codes copied, their slots
given back) at most REGISTER_GRACE seconds, MAX_EARLY_CHUNKS in all. A chunk of an aborted request, and one whose
Register does not come, is dropped and counted (StageStats.unknown_chunks).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

import numpy as np
import torch

from omni_tts.connectors.base import ChunkReaderBase
from omni_tts.connectors.kinds import chunk_reader
from omni_tts.engine.code2wav_engine import CodecChunk, Code2WavEngine, measure_frame_budget
from omni_tts.engine.code2wav_runner import Code2WavRunner
from omni_tts.models.qwen3_tts.model import load_speech_decoder

from . import aligner_stage
from .common import StageIO, run_stage
from .messages import (CONNECTOR_SECONDS_BUCKETS, STEP_SECONDS_BUCKETS, Abort, AudioEvent, DurationHistogram,
                       FailureKind, GetStats, Ready, Register, RequestFailure, Shutdown, StageLaunch, StageStats)

logger = logging.getLogger(__name__)

REGISTER_GRACE_NS = 2 * 10**9
MAX_EARLY_CHUNKS = 256
_RECENTLY_ABORTED = 4096  # their chunks still in flight are dropped at once, not held for a Register

class Code2WavStage:
    def __init__(self, launch: StageLaunch, condition: threading.Condition | None = None,
                 reader: ChunkReaderBase | None = None) -> None:
        """condition, reader: the loop's Condition and the connector's code2wav end (notifying it) when the process
        made them (the fused layout's in-process connector)."""
        cfg = launch.config
        decoder = load_speech_decoder(launch.model_dir, cfg.device, getattr(torch, cfg.dtype))
        runner = Code2WavRunner(decoder, launch.max_batch_size, cuda_graphs=not cfg.enforce_eager)
        frame_budget = cfg.frame_budget
        if frame_budget is None:
            frame_budget = measure_frame_budget(runner, launch.pipeline.connector.max_chunk_frames,
                                                launch.max_batch_size)
        logger.info("code2wav: %d frames per decoder call (%s), %d lane(s)", frame_budget,
                    "measured" if cfg.frame_budget is None else "configured", launch.lanes)
        self.engine = Code2WavEngine(decoder, launch.max_batch_size, frame_budget, launch.lanes, runner)
        if launch.aligner is not None:  # placement code2wav: the forced aligner beside the decoder
            aligner_stage.start_thread(launch.aligner)
        self.condition = condition or threading.Condition()
        self.io = StageIO(launch, self.condition)
        self.stage = launch.stage
        # one reader per talker it decodes for (a server of several models), all waking the loop
        self.readers = [reader] if reader is not None else [
            chunk_reader(spec, condition=self.condition, on_error=lambda e: self.io.thread_failed("connector", e))
            for spec in launch.readers]
        self.step_durations = DurationHistogram.empty(STEP_SECONDS_BUCKETS)
        self.connector_latencies = DurationHistogram.empty(CONNECTOR_SECONDS_BUCKETS)
        self.num_chunks = 0
        self.num_unknown_chunks = 0
        # chunks that came before their request's Register: id -> [(arrival ns, seq, chunk)], oldest request first
        self.early: collections.OrderedDict[str, list[tuple[int, int, CodecChunk]]] = collections.OrderedDict()
        self.num_early = 0
        self.aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.next_seq: dict[str, int] = {}   # each registered request's next chunk: a gap is a lost chunk

    def run(self) -> None:
        for reader in self.readers:
            reader.start()
        self.io.send(Ready(self.stage, os.getpid()))
        while True:
            self.io.wait(lambda: any(reader.stats().queued > 0 for reader in self.readers) or self.engine.has_work())
            for message in self.io.take_commands():
                if isinstance(message, Shutdown):
                    for reader in self.readers:
                        reader.close()
                    self.io.close()
                    return
                self._handle(message)
            now = time.monotonic_ns()
            for reader in self.readers:
                for chunk in reader.get_all_nowait():
                    self.connector_latencies.observe((now - chunk.put_ns) / 1e9)
                    self.num_chunks += 1
                    codec = CodecChunk(np.array(chunk.codes), chunk.is_last, chunk.is_context)
                    reader.release(chunk)
                    self._on_chunk(chunk.request_id, chunk.seq, codec, now)
            self._drop_early(lambda arrived: now - arrived > REGISTER_GRACE_NS)
            if self.engine.has_work():
                started = time.perf_counter()
                outputs = self.engine.step()
                self.step_durations.observe(time.perf_counter() - started)
                for out in outputs:
                    if out.finished:
                        self.next_seq.pop(out.request_id, None)
                    self.io.send(AudioEvent(out.request_id, out.audio.astype(np.float32).tobytes(), out.finished))

    def _on_chunk(self, rid: str, seq: int, chunk: CodecChunk, now: int) -> None:
        if rid in self.engine.requests:
            self._add_chunk(rid, seq, chunk)
        elif rid in self.aborted:
            self.num_unknown_chunks += 1
        else:
            self.early.setdefault(rid, []).append((now, seq, chunk))
            self.num_early += 1
            if self.num_early > MAX_EARLY_CHUNKS:
                self._drop_early(lambda arrived: True, count=1)

    def _drop_early(self, expired: Callable[[int], bool], count: int | None = None) -> None:
        """Drop the waiting chunks of the requests that waited longest, while `expired(first arrival)` (at least
        `count` chunks, when given)."""
        dropped = 0
        while self.early and (count is None or dropped < count):
            rid, chunks = next(iter(self.early.items()))
            if not expired(chunks[0][0]):
                return
            del self.early[rid]
            dropped += len(chunks)
            self.num_early -= len(chunks)
            self.num_unknown_chunks += len(chunks)
            logger.debug("%d chunk(s) of unknown request %r dropped", len(chunks), rid)

    def _add_chunk(self, rid: str, seq: int, chunk: CodecChunk) -> None:
        # which chunk and of what kind (reference codes or generated frames) says where to look
        where = f"chunk {seq} ({'reference context' if chunk.is_context else 'generated'})"
        expected = self.next_seq.get(rid, 0)
        if seq != expected:  # the audio would skip (or repeat) frames: the request fails instead
            logger.error("request %s: %s came where chunk %d was due", rid, where, expected)
            self._fail(rid, f"code2wav lost chunk {expected} of its codes ({where} came next)")
            return
        self.next_seq[rid] = seq + 1
        try:
            self.engine.add_chunk(rid, chunk)
        except ValueError as e:
            logger.error("request %s: %s refused: %s: %s", rid, where, e, chunk.codes.tolist())
            self._fail(rid, f"code2wav cannot decode its codes: {where}: {e}")

    def _fail(self, rid: str, message: str) -> None:
        """The request ends here, failed: the talker made its chunks (given reference codes are checked against the
        codebook before), so the fault is ours, not the request's."""
        self._abort(rid)
        self.io.send(AudioEvent(rid, b"", True, failure=RequestFailure(FailureKind.INTERNAL, message)))

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.next_seq.pop(rid, None)
        chunks = self.early.pop(rid, [])
        self.num_early -= len(chunks)
        self.num_unknown_chunks += len(chunks)
        self.aborted[rid] = None
        while len(self.aborted) > _RECENTLY_ABORTED:
            self.aborted.popitem(last=False)

    def _handle(self, message: object) -> None:
        if isinstance(message, Register):
            rid = message.request_id
            self.aborted.pop(rid, None)
            self.engine.add_request(rid)
            chunks = self.early.pop(rid, [])
            self.num_early -= len(chunks)
            for _, seq, chunk in chunks:
                if rid in self.engine.requests:  # not refused meanwhile
                    self._add_chunk(rid, seq, chunk)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        elif isinstance(message, GetStats):
            self.io.send(StageStats(self.stage, os.getpid(), list(self.engine.requests), self.engine.num_steps,
                                    time.process_time(), self.step_durations, self.num_chunks,
                                    self.connector_latencies, self.num_unknown_chunks))


def main(launch_bytes: bytes) -> None:
    run_stage(launch_bytes, lambda launch: Code2WavStage(launch).run())
