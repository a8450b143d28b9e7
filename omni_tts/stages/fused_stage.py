"""The fused layout's one process (connector kind `local`, `qwen3_tts_1gpu_fused.yaml`): the talker and code2wav
stages side by side, chunks handed over in memory (`connectors/local.py`).

Each stage keeps its own loop, control socket, heartbeat and failure report, so the orchestrator drives them as it
drives two processes; what goes is the second process, its CUDA context and the shared-memory ring. The talker runs
on this thread, code2wav on a thread of its own. On a GPU each has a CUDA stream of its own, the decoder's at a
higher priority (frames already made are closer to a listener than new ones), so decoder calls overlap talker steps
instead of queueing behind them. The decoder's stream never waits on the talker's: the talker reads every frame on
the host anyway (end of speech, chunking, usage: one event wait per step, `TalkerRunner.decode`), and the decoder
takes its codes from pinned host memory. Both stages are built (their CUDA graphs captured) before either loop
runs: a capture must not see another thread's work.
"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from omni_tts.connectors.local import LocalSpec, local_pair

from .code2wav_stage import Code2WavStage
from .common import fail_process, run_stages
from .messages import StageLaunch
from .talker_stage import TalkerStage


def main(talker_launch: bytes, code2wav_launch: bytes) -> None:
    run_stages((talker_launch, code2wav_launch), _run)


def _run(launches: list[StageLaunch]) -> None:
    talker_launch, code2wav_launch = launches
    assert isinstance(talker_launch.connector, LocalSpec), "the fused layout hands chunks over in memory"
    condition = threading.Condition()
    writer, reader = local_pair(talker_launch.connector, condition)
    code2wav = Code2WavStage(code2wav_launch, condition, reader)
    talker = TalkerStage(talker_launch, writer)
    decoder = threading.Thread(target=_run_code2wav, args=(code2wav, code2wav_launch), name="omni-tts-code2wav",
                               daemon=True)
    decoder.start()
    with _own_stream(talker_launch.config.device, priority=0):
        talker.run()
    decoder.join()  # Shutdown reaches both loops; the process ends when both have returned


def _run_code2wav(stage: Code2WavStage, launch: StageLaunch) -> None:
    try:
        with _own_stream(launch.config.device, priority=-1):
            stage.run()
    except BaseException as e:
        fail_process(launch, e)


def _own_stream(device: str, priority: int) -> AbstractContextManager:
    """A CUDA stream of the calling thread's own (lower priority values run first); nothing on the CPU."""
    if not device.startswith("cuda"):
        return nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device, priority=priority))
