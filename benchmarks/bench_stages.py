"""Per-step timings of the talker and code2wav engines on this machine (in-process, no sockets).

    python benchmarks/bench_stages.py [--preset tiny small medium] [--batch 1 4 16] [--threads 2]

Builds a random checkpoint of each preset (omni-tts make-tiny-model) in a temp dir, then times
  - talker: one decode step (code predictor for 16 codebooks + talker) with B running requests,
  - code2wav: one streaming decode call of B requests × F frames (F = 2: first packet, F = 25: steady chunk),
and prints two Markdown tables: every step (median and p90 wall time over the timed steps, real-time factor per
request), then talker against code2wav per 80 ms of audio of one request (one frame): talker step ÷ B against
25-frame chunk ÷ (25 B), as wall time and as this process's CPU time (robust to other load on a shared machine).
A ratio ≥ 1 means the decoder costs at least as much as the talker per second of audio.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from omni_tts.engine.code2wav_engine import CodecChunk, Code2WavEngine
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import PRESETS, make_random_model
from omni_tts.models.qwen3_tts.sampling import SamplingParams

FRAME_SECONDS = 0.08


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


Timings = tuple[list[float], list[float]]  # (wall seconds, process CPU seconds) per timed step


def timed(step) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


def time_talker(tts: Qwen3TTS, batch: int, steps: int) -> Timings:
    engine = TalkerEngine(tts.talker, tts.config, batch, 1024, 4096, 512)
    for i in range(batch):
        p = prepare(tts, SynthesisRequest(text=f"Benchmark sentence number {i}, long enough to keep going.",
                                          voice="ryan", sampling=SamplingParams(temperature=0.9, seed=i,
                                                                                repetition_penalty=1.0)))
        engine.add_request(TalkerRequest(f"r{i}", p.prefill, p.trailing, p.sampling, 10_000))
    engine.step()  # admission + first step
    # keep every row running: we time steady-state steps, not utterance lengths (the EOS id lives on the scheduler)
    setattr(getattr(engine, "scheduler", engine), "eos", -1)
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = timed(engine.step)
        walls.append(wall)
        cpus.append(cpu)
    return walls, cpus


def time_code2wav(tts: Qwen3TTS, batch: int, frames: int, steps: int) -> Timings:
    engine = Code2WavEngine(tts.decoder, batch)
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"r{i}")
    walls, cpus = [], []
    for _ in range(steps + 1):
        for i in range(batch):
            engine.add_chunk(f"r{i}", CodecChunk(rng.integers(0, 2048, (frames, 16))))
        wall, cpu = timed(engine.step)
        walls.append(wall)
        cpus.append(cpu)
    return walls[1:], cpus[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["tiny", "small"], choices=PRESETS)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=20, help="timed talker steps and 2-frame chunks")
    ap.add_argument("--chunk-steps", type=int, help="timed 25-frame chunks (default max(3, steps / 5))")
    ap.add_argument("--frames", nargs="+", type=int, default=[2, 25], help="code2wav chunk sizes")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.preset:
            model_dir = make_random_model(f"{tmp}/{preset}", "custom_voice", preset, seed=0, dtype=torch.float32)
            tts = Qwen3TTS(model_dir)
            for batch in args.batch:
                t = time_talker(tts, batch, args.steps)
                rows.append((preset, "talker step", batch, 1, t))
                for frames in args.frames:
                    steps = args.steps if frames < 25 else (args.chunk_steps or max(3, args.steps // 5))
                    t = time_code2wav(tts, batch, frames, steps)
                    rows.append((preset, f"code2wav {frames}-frame chunk", batch, frames, t))
    print(f"torch {torch.__version__}, {args.threads} threads\n")
    print("| preset | step | batch | p50 ms | p90 ms | audio per step per request | RTF (p50 / audio) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for preset, name, batch, frames, (t, _) in rows:
        p50 = statistics.median(t)
        audio = frames * FRAME_SECONDS
        print(f"| {preset} | {name} | {batch} | {p50 * 1e3:.1f} | {percentile(t, 90) * 1e3:.1f} | "
              f"{audio * 1e3:.0f} ms | {p50 / audio:.3f} |")
    if 25 not in args.frames:
        return
    print("\nCost per 80 ms of one request's audio (p50 step ÷ frames produced per request × B):\n")
    print("| preset | batch | talker wall ms | code2wav wall ms | code2wav ÷ talker | talker CPU ms | "
          "code2wav CPU ms | code2wav ÷ talker (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    by_key = {(preset, name, batch): (frames, t) for preset, name, batch, frames, t in rows}
    for preset in args.preset:
        for batch in args.batch:
            talker, decoder = by_key[(preset, "talker step", batch)], by_key[(preset, "code2wav 25-frame chunk", batch)]
            per_frame = [[statistics.median(x) / (f * batch) * 1e3 for x in t] for f, t in (talker, decoder)]
            (t_wall, t_cpu), (d_wall, d_cpu) = per_frame
            print(f"| {preset} | {batch} | {t_wall:.2f} | {d_wall:.2f} | {d_wall / t_wall:.2f} | {t_cpu:.2f} | "
                  f"{d_cpu:.2f} | {d_cpu / t_cpu:.2f} |")


if __name__ == "__main__":
    main()
