"""The forced-aligner stage: word times of finished audio, batched across requests, off the audio path; a process of
its own (`main`), or a thread of code2wav's process (`start_thread`, placement `code2wav`).

Commands arrive on a PULL socket (AlignSpan, DropSpan, Abort, Shutdown); each loop takes every waiting span, up to
`max_batch_size`, into one aligner call and answers each with a SpanAligned. A span the aligner cannot take
(its batch raised) is retried alone, so one bad span fails only itself. The process runs below the TTS stages'
priority: timestamps may trail, audio may not. It sends heartbeats as the TTS stages do (stages/common.py), so a
stopped or stuck aligner is found; a crash is reported (StageFailed); either way the orchestrator restarts it.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
import traceback

import msgspec
import numpy as np
import torch
import zmq

from omni_tts.config.threads import set_torch_threads
from omni_tts.log import configure_logging
from omni_tts.models.qwen3_forced_aligner.aligner import AlignItem, ForcedAligner

from .common import LOOP_CLOCKS, LoopClock, fail_process, name_process, start_heartbeats
from .messages import (Abort, AlignerCommand, AlignerLaunch, AlignSpan, DropSpan, Ready, SpanAligned, Shutdown,
                       StageFailed)

logger = logging.getLogger(__name__)

ALIGNER_NICENESS = 10   # below the talker's 8 and code2wav's 5
SIMILAR_LENGTH = 1.25   # clips batched together differ in length by at most this factor


def main(launch_bytes: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops it (Shutdown); see common.run_stages
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    launch = msgspec.msgpack.decode(launch_bytes, type=AlignerLaunch)
    name_process("omni-tts-aligner")
    configure_logging(launch.log_level)
    if launch.device == "cpu":
        os.nice(ALIGNER_NICENESS)
    set_torch_threads(launch.threads)
    start_heartbeats([launch])   # its thread also ends the process when the server is gone
    commands, events = _sockets(zmq.Context(), launch)
    try:
        aligner = ForcedAligner(launch.model_dir, launch.device, getattr(torch, launch.dtype))
        events.send(msgspec.msgpack.encode(Ready(launch.stage, os.getpid())))
        _serve(aligner, launch, commands, events)
        os._exit(0)
    except BaseException as e:
        fail_process(launch, e)


def start_thread(launch: AlignerLaunch) -> threading.Thread:
    """The aligner on a thread of the calling stage process (placement `code2wav`): its own sockets, the process's
    device and torch threads (the process's heartbeats are code2wav's: its hang is the pipeline's). Its failure is
    reported (StageFailed "aligner") and ends only the thread: the stage's audio goes on; the aligner comes back when
    the pipeline restarts the process."""
    def run() -> None:
        ctx = zmq.Context()
        commands, events = _sockets(ctx, launch)
        try:
            aligner = ForcedAligner(launch.model_dir, launch.device, getattr(torch, launch.dtype))
            events.send(msgspec.msgpack.encode(Ready(launch.stage, os.getpid())))
            _serve(aligner, launch, commands, events)
        except Exception as e:  # noqa: BLE001 - reported, and the thread ends
            logger.exception("aligner thread failed")
            events.send(msgspec.msgpack.encode(StageFailed(launch.stage, traceback.format_exc(),
                                                           f"{type(e).__name__}: {e}")))
        finally:
            ctx.destroy(linger=1000)

    thread = threading.Thread(target=run, name="omni-tts-aligner", daemon=True)
    thread.start()
    return thread


def _sockets(ctx: zmq.Context, launch: AlignerLaunch) -> tuple[zmq.Socket, zmq.Socket]:
    commands = ctx.socket(zmq.PULL)
    commands.bind(launch.command_address)
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 1000)
    events.connect(launch.event_address)
    return commands, events


def _serve(aligner: ForcedAligner, launch: AlignerLaunch, commands: zmq.Socket, events: zmq.Socket) -> None:
    decoder, encoder = msgspec.msgpack.Decoder(AlignerCommand), msgspec.msgpack.Encoder()
    clock = LOOP_CLOCKS.setdefault(launch.stage, LoopClock())   # what its heartbeats say: busy since when
    pending: collections.deque[AlignSpan] = collections.deque()
    while True:
        if not pending:
            clock.busy_since = None
            commands.poll()
        clock.busy_since = time.monotonic()
        while commands.poll(0):
            command = decoder.decode(commands.recv())
            if isinstance(command, Shutdown):
                return
            if isinstance(command, Abort):
                pending = collections.deque(s for s in pending if s.request_id != command.request_id)
            elif isinstance(command, DropSpan):
                pending = collections.deque(s for s in pending
                                            if (s.request_id, s.span) != (command.request_id, command.span))
            else:
                pending.append(command)
        if not pending:  # an Abort took what was waiting
            continue
        batch = _take_batch(pending, launch.max_batch_size)
        for answer in _align(aligner, batch):
            events.send(encoder.encode(answer))


def _take_batch(pending: collections.deque[AlignSpan], max_size: int) -> list[AlignSpan]:
    """The oldest span and, up to `max_size`, the waiting ones of about its length: a batch is padded to its
    longest prompt, so mixing a long clip with short ones costs more than aligning them apart (measured:
    docs/benchmarks.md)."""
    first = pending.popleft()
    batch, rest = [first], collections.deque()
    while pending:
        span = pending.popleft()
        if len(batch) < max_size and _similar(_seconds(span), _seconds(first)):
            batch.append(span)
        else:
            rest.append(span)
    pending.extend(rest)
    return batch


def _seconds(span: AlignSpan) -> float:
    return len(span.pcm) / 4 / span.sample_rate


def _similar(a: float, b: float) -> bool:
    return max(a, b) <= SIMILAR_LENGTH * min(a, b)


def _align(aligner: ForcedAligner, batch: list[AlignSpan]) -> list[SpanAligned]:
    items = [AlignItem(np.frombuffer(s.pcm, dtype=np.float32), s.sample_rate, s.text, s.language) for s in batch]
    try:
        results = aligner.align(items)
    except Exception:
        if len(batch) > 1:  # find the span that cannot be aligned: each alone
            return [answer for s in batch for answer in _align(aligner, [s])]
        logger.exception("aligner: span %d of request %s failed", batch[0].span, batch[0].request_id)
        return [SpanAligned(batch[0].request_id, batch[0].span, error="the aligner failed on this audio")]
    return [SpanAligned(s.request_id, s.span, [(w.word, w.start_ms, w.end_ms) for w in words])
            for s, words in zip(batch, results)]
