"""Per-step timings of the talker and code2wav engines on this machine (in-process, no sockets).

    python benchmarks/bench_stages.py [--preset tiny small] [--batch 1 4 16] [--threads 2]

Builds a random checkpoint of each preset (omni-tts make-tiny-model) in a temp dir, then times
  - talker: one decode step (code predictor for 16 codebooks + talker) with B running requests,
  - code2wav: one streaming decode call of B requests × F frames (F = 2: first packet, F = 25: steady chunk),
and prints a Markdown table (median and p90 over the timed steps, with real-time factor per request).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from omni_tts.engine.code2wav_engine import CodecChunk, Code2WavEngine
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_model
from omni_tts.models.qwen3_tts.sampling import SamplingParams

FRAME_SECONDS = 0.08


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def time_talker(tts: Qwen3TTS, batch: int, steps: int) -> list[float]:
    engine = TalkerEngine(tts.talker, tts.config, batch, 1024, 4096, 512)
    for i in range(batch):
        p = tts.prepare(SynthesisRequest(text=f"Benchmark sentence number {i}, long enough to keep going.",
                                         voice="ryan", sampling=SamplingParams(temperature=0.9, seed=i,
                                                                               repetition_penalty=1.0)))
        engine.add_request(TalkerRequest(f"r{i}", p.prefill, p.trailing, p.sampling, 10_000))
    engine.step()  # admission + first step
    engine.eos = -1  # keep every row running: we time steady-state steps, not utterance lengths
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def time_code2wav(tts: Qwen3TTS, batch: int, frames: int, steps: int) -> list[float]:
    engine = Code2WavEngine(tts.decoder, batch)
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"r{i}")
    times = []
    for _ in range(steps + 1):
        for i in range(batch):
            engine.add_chunk(f"r{i}", CodecChunk(rng.integers(0, 2048, (frames, 16))))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=20)
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
                for frames in (2, 25):
                    t = time_code2wav(tts, batch, frames, max(3, args.steps // (5 if frames == 25 else 1)))
                    rows.append((preset, f"code2wav {frames}-frame chunk", batch, frames, t))
    print(f"torch {torch.__version__}, {args.threads} threads\n")
    print("| preset | step | batch | p50 ms | p90 ms | audio per step per request | RTF (p50 / audio) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for preset, name, batch, frames, t in rows:
        p50 = statistics.median(t)
        audio = frames * FRAME_SECONDS
        print(f"| {preset} | {name} | {batch} | {p50 * 1e3:.1f} | {percentile(t, 90) * 1e3:.1f} | "
              f"{audio * 1e3:.0f} ms | {p50 / audio:.3f} |")


if __name__ == "__main__":
    main()
