"""The aligner stage's loop (`aligner_stage._serve`) with the tiny aligner on sockets of this process: a span its
response gave up on (DropSpan) is not aligned if it still waits, and the loop's heartbeat clock says it is idle once
it waits for work."""
import threading

import msgspec
import numpy as np
import torch
import zmq

from conftest import FIXTURES
from omni_tts.models.qwen3_forced_aligner.aligner import ForcedAligner
from omni_tts.stages.aligner_stage import _serve, _sockets
from omni_tts.stages.common import LOOP_CLOCKS
from omni_tts.stages.messages import AlignerEvent, AlignerLaunch, AlignSpan, DropSpan, Shutdown, SpanAligned
from waiting import eventually

ALIGNER = FIXTURES.parent / "qwen3_forced_aligner" / "tiny-forced-aligner"


def test_a_dropped_span_that_still_waits_is_not_aligned():
    launch = AlignerLaunch(stage="aligner", model_dir=str(ALIGNER), device="cpu", dtype="float32", threads=1,
                           max_batch_size=4, command_address="inproc://commands", event_address="inproc://events")
    ctx = zmq.Context()
    answers = ctx.socket(zmq.PULL)
    answers.bind(launch.event_address)
    commands, events = _sockets(ctx, launch)
    client = ctx.socket(zmq.PUSH)
    client.connect(launch.command_address)
    audio = np.zeros(24000, np.float32).tobytes()
    # all three wait before the loop starts (inproc: a sent message is there to read), so its first read takes them
    for command in [AlignSpan("r", 0, "Hello world.", None, audio, 24000),
                    AlignSpan("r", 1, "Hello again.", None, audio, 24000), DropSpan("r", 0)]:
        client.send(msgspec.msgpack.encode(command))
    loop = threading.Thread(target=_serve, args=(ForcedAligner(str(ALIGNER), "cpu", torch.float32), launch, commands,
                                                 events))
    loop.start()
    try:
        assert answers.poll(60_000)
        answer = msgspec.msgpack.decode(answers.recv(), type=AlignerEvent)
        assert isinstance(answer, SpanAligned) and (answer.span, answer.error) == (1, None) and answer.words
        eventually(lambda: LOOP_CLOCKS["aligner"].busy_since is None, what="the loop idle")
    finally:
        client.send(msgspec.msgpack.encode(Shutdown()))
        loop.join()
    assert not answers.poll(0)   # span 0 was never aligned
    ctx.destroy(linger=0)
