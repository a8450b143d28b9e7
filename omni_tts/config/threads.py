"""CPU thread budget of the stage processes.

torch sizes its intra-op pool to every core by default, so two stage processes beside the API process would each
spin OpenMP threads against the others, and oversubscribed they lose most of their throughput (`docs/benchmarks.md`,
Thread splits). Every computing process therefore gets an explicit share: a stage's `threads:` from the YAML,
otherwise a split of the cores this process may run on.
"""
from __future__ import annotations

import os

from .stage_config import PipelineConfig

# a stage on a GPU only launches kernels and copies results: one host thread
GPU_STAGE_THREADS = 1


def available_cpus() -> int:
    """Cores this process may run on (cgroup/taskset affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def stage_threads(pipeline: PipelineConfig, cpus: int | None = None) -> dict[str, int]:
    """Threads per stage: the YAML's `threads`, else 1 for a GPU stage, else a share of `cpus`.

    The API process keeps one core to itself when there are more than two (below that it runs beside the stages,
    which sit at a lower priority); the CPU stages split the rest, the odd core going to code2wav, whose
    convolutions scale with threads better than the talker's many small per-step operations."""
    cpus = available_cpus() if cpus is None else cpus
    stages = {"talker": pipeline.stages.talker, "code2wav": pipeline.stages.code2wav}
    on_cpu = [name for name, cfg in stages.items() if cfg.threads is None and cfg.device == "cpu"]
    spare = max(1, cpus - (1 if cpus > 2 else 0) - sum(cfg.threads or 0 for cfg in stages.values()))
    shares = {}
    if len(on_cpu) == 2:
        shares = {"talker": max(1, spare // 2), "code2wav": max(1, spare - spare // 2)}
    elif on_cpu:
        shares = {on_cpu[0]: spare}
    return {name: cfg.threads or shares.get(name, GPU_STAGE_THREADS) for name, cfg in stages.items()}


def set_torch_threads(threads: int) -> None:
    """This process's intra-op pool to `threads`, inter-op to 1 (the stages run one model call at a time)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op parallel work; then it is left as it is
        pass


def code2wav_lanes(pipeline: PipelineConfig, threads: dict[str, int]) -> int:
    """Decoder calls code2wav runs at once: the YAML's `lanes`, else 1 plus one per code2wav-sized share of the
    talker's cores when both stages compute on the CPU.

    The extra lanes oversubscribe the cores on purpose: the talker at its lower priority yields them to decoding and
    takes them back whenever code2wav waits, which keeps both cores busy where a fixed split leaves part of the
    talker's idle; and separate calls on separate threads scale where one call on two threads does not (figures:
    `docs/benchmarks.md`, Decoder lanes)."""
    stages = pipeline.stages
    if stages.code2wav.lanes is not None:
        return stages.code2wav.lanes
    both_on_cpu = stages.talker.device == stages.code2wav.device == "cpu"
    return 1 + (threads["talker"] // threads["code2wav"] if both_on_cpu else 0)


def stage_environment(stage: str) -> dict[str, str]:
    """What the `stage` process sets in its environment before it loads a runtime (stages/bootstrap.py): the
    talker's OpenMP workers sleep when idle (OMP_WAIT_POLICY=PASSIVE, unless the user set it) instead of spinning for
    a core code2wav needs. code2wav keeps the runtime's default (spin briefly, then sleep): with passive workers
    every parallel region waits for a futex wake-up, and its decoder calls gain nothing from a second thread
    (measured)."""
    if stage == "talker" and "OMP_WAIT_POLICY" not in os.environ:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}
