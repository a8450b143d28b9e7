"""How many replicas (and GPUs) for N concurrent real-time streams, from one replica's measured curve.

    python benchmarks/capacity_plan.py RESULT.json [--ttfp-target 1.0] [--streams 10 100 1000]
        [--replicas-per-gpu 1] [--headroom 0.2]

RESULT.json is a `bench_tts_serve.py` run against one replica (its levels at several concurrencies). A replica
carries c streams in real time when its aggregate audio rate A(c) (audio-seconds per second, all streams together)
is at least c × (1 + headroom) — each stream then gets audio faster than it plays — and its TTFP p99 at c is within
the target. A(c) and TTFP are interpolated linearly between measured levels, never extrapolated beyond the largest
one, so the plan is as good as the levels measured. Exits 2 with a message when the file is not such a result or no
measured level meets the target.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    concurrency: int
    audio_rate: float     # audio-seconds per second, all streams together
    ttfp_p99: float       # seconds


def read_levels(path: str) -> list[Level]:
    with open(path) as f:
        run = json.load(f)
    levels = [Level(level["concurrency"], level["aggregates"]["audio_seconds_per_second"],
                    level["aggregates"]["ttfp_s"]["p99"])
              for level in run.get("levels", []) if level.get("concurrency")]
    if not levels:
        raise ValueError(f"{path}: not a bench_tts_serve.py result with concurrency levels")
    return sorted(levels, key=lambda level: level.concurrency)


def _interpolate(levels: list[Level], c: float) -> tuple[float, float]:
    """(audio rate, TTFP p99) at concurrency c, between the measured levels around it."""
    for low, high in zip(levels, levels[1:]):
        if low.concurrency <= c <= high.concurrency:
            t = (c - low.concurrency) / (high.concurrency - low.concurrency)
            return (low.audio_rate + t * (high.audio_rate - low.audio_rate),
                    low.ttfp_p99 + t * (high.ttfp_p99 - low.ttfp_p99))
    return levels[0].audio_rate, levels[0].ttfp_p99  # c below the first level: its figures (conservative)


def streams_per_replica(levels: list[Level], ttfp_target: float, headroom: float) -> int:
    """The most concurrent streams one replica keeps in real time within the TTFP target (0 if none)."""
    best = 0
    for c in range(1, levels[-1].concurrency + 1):
        audio_rate, ttfp = _interpolate(levels, c)
        if audio_rate >= c * (1 + headroom) and ttfp <= ttfp_target:
            best = c
    return best


def plan(levels: list[Level], streams: list[int], ttfp_target: float, headroom: float,
         replicas_per_gpu: int) -> list[dict]:
    per_replica = streams_per_replica(levels, ttfp_target, headroom)
    if per_replica == 0:
        raise ValueError(f"no measured level keeps even one stream in real time with TTFP p99 <= {ttfp_target:g} s")
    return [{"streams": n, "streams_per_replica": per_replica, "replicas": math.ceil(n / per_replica),
             "gpus": math.ceil(math.ceil(n / per_replica) / replicas_per_gpu)} for n in streams]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="bench_tts_serve.py JSON of one replica")
    parser.add_argument("--ttfp-target", type=float, default=1.0, help="TTFP p99 target, seconds")
    parser.add_argument("--streams", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--replicas-per-gpu", type=int, default=1, help="replicas sharing one GPU (MPS)")
    parser.add_argument("--headroom", type=float, default=0.2, help="audio made beyond real time, as a fraction")
    args = parser.parse_args(argv)
    try:
        levels = read_levels(args.result)
        rows = plan(levels, args.streams, args.ttfp_target, args.headroom, args.replicas_per_gpu)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"capacity_plan: error: {e}", file=sys.stderr)
        return 2
    print("| concurrency | audio-s/s | TTFP p99 s |\n|---:|---:|---:|")
    for level in levels:
        print(f"| {level.concurrency} | {level.audio_rate:.2f} | {level.ttfp_p99:.3f} |")
    print(f"\none replica: {rows[0]['streams_per_replica']} real-time streams (TTFP p99 <= {args.ttfp_target:g} s, "
          f"{args.headroom:.0%} headroom)\n\n| streams | replicas | GPUs ({args.replicas_per_gpu} per GPU) |\n|---:|---:|---:|")
    for row in rows:
        print(f"| {row['streams']} | {row['replicas']} | {row['gpus']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
