"""What serving several models in one server costs (issue 36), on this machine:

    python benchmarks/bench_several_models.py [--preset small] [--models 3] [--concurrency 12] [--max-new-tokens 60]

Builds a random CustomVoice checkpoint of the preset (omni-tts make-tiny-model) and runs AsyncTTS (stage config
cpu_tiny, real stage processes) twice, one after the other: one model, then the same checkpoint under `--models`
names (a talker each, one code2wav for all: their decoders are the same). Each run sends `--concurrency` greedy
requests at once, spread over its models, and reports every stage process's memory (PSS, from
/proc/PID/smaps_rollup: shared pages split between the processes that map them), the memory each added model costs,
the audio made per second and the time to first audio (p50, p90). Then the added models' talkers are unloaded as
idle ones are (`--idle-unload`) and the memory given back is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import numpy as np

from omni_tts.config import load_stage_config
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import PRESETS, make_random_model
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.model_layout import ServedCheckpoint

VOICES = ["ryan", "vivian", "serena", "aiden"]


def pss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return kib / 1024


async def run(models: list[ServedCheckpoint], concurrency: int, max_new_tokens: int) -> dict:
    async with AsyncTTS(models, load_stage_config("cpu_tiny")) as engine:
        async def one(i: int) -> tuple[float, float]:
            request = SynthesisRequest(text=f"Sentence number {i} is spoken by one of several models.",
                                       voice=VOICES[i % len(VOICES)],
                                       sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens))
            started, first, samples = time.perf_counter(), None, 0
            async for chunk in engine.generate(request, model=models[i % len(models)].name):
                if first is None and chunk.audio.shape[0]:
                    first = time.perf_counter() - started
                samples += chunk.audio.shape[0]
            return first, samples / 24000

        await asyncio.gather(*(one(i) for i in range(len(models))))   # every talker warm
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(concurrency)))
        wall = time.perf_counter() - started
        memory = {stage: pss_mib(pid) for stage, pid in engine.stage_pids().items()}
        unloaded = None
        if len(models) > 1:
            for model in models[1:]:
                await engine.supervisor.unload(engine.layout.talker_of[model.name])
            unloaded = {stage: pss_mib(pid) for stage, pid in engine.stage_pids().items()}
    firsts = np.array([first for first, _ in results])
    return {"memory": memory, "unloaded": unloaded, "audio_per_s": sum(s for _, s in results) / wall,
            "ttfp_p50": float(np.percentile(firsts, 50)), "ttfp_p90": float(np.percentile(firsts, 90))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=PRESETS)
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model(os.path.join(tmp, args.preset), preset=args.preset)
        runs = {count: asyncio.run(run([ServedCheckpoint(f"m{i}", model_dir) for i in range(count)],
                                       args.concurrency, args.max_new_tokens))
                for count in (1, args.models)}
    one, many = runs[1], runs[args.models]
    print(f"preset {args.preset}, {args.concurrency} requests at once, {args.max_new_tokens} frames at most, "
          f"{os.cpu_count()} cores\n")
    print("| models | stage processes (PSS MiB) | total MiB | audio s/s | first audio p50 / p90 ms |")
    print("|---|---|---|---|---|")
    for count, result in runs.items():
        stages = ", ".join(f"{stage} {mib:.0f}" for stage, mib in result["memory"].items())
        print(f"| {count} | {stages} | {sum(result['memory'].values()):.0f} | {result['audio_per_s']:.2f} | "
              f"{result['ttfp_p50'] * 1000:.0f} / {result['ttfp_p90'] * 1000:.0f} |")
    added = (sum(many["memory"].values()) - sum(one["memory"].values())) / (args.models - 1)
    print(f"\neach added model: {added:.0f} MiB (its talker process); after unloading the {args.models - 1} added "
          f"talkers: {sum(many['unloaded'].values()):.0f} MiB in all")


if __name__ == "__main__":
    main()
