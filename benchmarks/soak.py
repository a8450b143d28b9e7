"""Soak: a bounded loopback run above capacity that checks every response and watches the server's resources.

    python benchmarks/soak.py --duration 600                 # the issue-10 run: 10 minutes, 2x measured capacity
    python benchmarks/soak.py --duration 30 --name smoke      # a quick look

Starts `omni-tts serve` (the embedded tiny model unless --model) on a free loopback port, measures its capacity
(requests/s of the request mix at concurrency --max-queue), then sends Poisson arrivals at --load x that rate for --duration
seconds: greedy requests of mixed lengths and voices; 60 % streamed pcm and 15 % whole wav, each compared with its
offline synthesis (same length, within one int16 step: no loss, no mixing); 20 % hang up after the first 4 KiB;
5 % read 4 KiB per 0.5 s (slow clients). Every second it records the server's RSS, open fds and /dev/shm bytes
(all its processes) and /health latency. Writes <result-dir>/<name>.json and .md: status counts per kind, mismatches,
5xx, resource slopes over the second half (MiB or fds per minute) and /health p50/p99/max. Exit status 1 when a
response was lost or mixed or a 5xx was answered.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import io
import os
import random
import sys
import time

import aiohttp
import numpy as np
import soundfile as sf

from bench_runner import HERE
from server_probe import (Speech, expected_pcm, health_latency, matches, resources, run_against_server,
                          slope_per_minute, stream_speech)

TEXTS = ["Hi.", "Good morning, everyone.", "A somewhat longer sentence, with a pause or two, to make it last.",
         "今天天气很好。", "Numbers like 42 and 2026 are read aloud, one after the other."]
VOICES = ["ryan", "vivian", "serena"]
MAX_NEW_TOKENS = [20, 60, 120]
KINDS = [("stream", 0.60), ("whole_wav", 0.15), ("disconnect", 0.20), ("slow", 0.05)]
MODEL = "soak"


def mix(rng: random.Random, n: int) -> list[tuple[str, Speech]]:
    kinds, weights = zip(*KINDS)
    return [(rng.choices(kinds, weights)[0],
             Speech(rng.choice(TEXTS), rng.choice(VOICES), rng.choice(MAX_NEW_TOKENS))) for _ in range(n)]


async def whole_wav(session: aiohttp.ClientSession, url: str, speech: Speech) -> tuple[int | str, bytes, bool]:
    try:
        async with session.post(url + "/v1/audio/speech", json=speech.body(MODEL, response_format="wav"),
                                timeout=aiohttp.ClientTimeout(total=300)) as r:
            data = await r.read()
            if r.status != 200:
                return r.status, b"", False
            pcm, _ = sf.read(io.BytesIO(data), dtype="int16")
            return 200, pcm.tobytes(), True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"error: {type(e).__name__}", b"", False


async def one(session: aiohttp.ClientSession, url: str, kind: str, speech: Speech) -> tuple[int | str, bytes, bool]:
    if kind == "whole_wav":
        return await whole_wav(session, url, speech)
    outcome = await stream_speech(session, url, speech.body(MODEL), read_delay=0.5 if kind == "slow" else 0.0,
                                  disconnect_after=4096 if kind == "disconnect" else None)
    return outcome.status, outcome.pcm, outcome.complete


async def measure_capacity(session: aiohttp.ClientSession, url: str, rng: random.Random, concurrency: int) -> float:
    """Requests/s of the mix's complete kinds with `concurrency` in flight (what the server sustains)."""
    work = [s for k, s in mix(rng, 6 * concurrency) if k in ("stream", "whole_wav")][:3 * concurrency]
    started = time.monotonic()
    queue = collections.deque(work)

    async def worker() -> None:
        while queue:
            await stream_speech(session, url, queue.popleft().body(MODEL))
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(work) / (time.monotonic() - started)


async def soak(url: str, server_pid: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        capacity = await measure_capacity(session, url, rng, args.max_queue)
        rate = args.rate or args.load * capacity
        print(f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s for {args.duration:.0f} s", file=sys.stderr)
        arrivals, t = [], rng.expovariate(rate)
        while t < args.duration:
            arrivals.append(t)
            t += rng.expovariate(rate)
        plan = mix(rng, len(arrivals))
        print(f"{len(plan)} requests; offline references for {len(set(s for _, s in plan))} distinct ones",
              file=sys.stderr)
        expected = expected_pcm(args.model, [s for _, s in plan])
        series: list[dict] = []
        health: list[float] = []
        health_failures = 0
        started = time.monotonic()
        stop = asyncio.Event()

        async def monitor() -> None:
            nonlocal health_failures
            while not stop.is_set():
                status, seconds = await health_latency(session, url)
                health.append(seconds)
                health_failures += status != 200
                series.append({"t": time.monotonic() - started, **resources(server_pid)})
                await asyncio.sleep(1.0)

        async def send(at: float, kind: str, speech: Speech) -> tuple[str, Speech, int | str, bytes, bool]:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            return (kind, speech, *await one(session, url, kind, speech))

        watcher = asyncio.create_task(monitor())
        results = await asyncio.gather(*(send(at, k, s) for at, (k, s) in zip(arrivals, plan)))
        drained_at = time.monotonic() - started
        await asyncio.sleep(3.0)  # resources after the load, once aborted work is freed
        stop.set()
        await watcher

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    mismatched, lost, server_errors = [], 0, 0
    for kind, speech, status, pcm, complete in results:
        counts[kind][str(status)] += 1
        server_errors += isinstance(status, int) and status >= 500
        if kind in ("stream", "whole_wav") and status == 200:
            if not complete:
                lost += 1
            elif not matches(pcm, expected[speech]):
                mismatched.append({"kind": kind, "text": speech.text, "voice": speech.voice,
                                   "max_new_tokens": speech.max_new_tokens, "samples": len(pcm) // 2,
                                   "expected_samples": int(expected[speech].shape[0])})
        elif kind in ("stream", "whole_wav", "slow") and isinstance(status, str):
            lost += 1  # the connection failed without an HTTP answer
    half = [p for p in series if p["t"] >= series[-1]["t"] / 2] if series else []
    figures = {key: {"first": series[0][key], "last": series[-1][key], "max": max(p[key] for p in series),
                     "slope_per_min_second_half": slope_per_minute([p["t"] for p in half], [p[key] for p in half])}
               for key in ("rss_mib", "fds", "shm_mib")} if series else {}
    h = np.asarray(health) * 1e3 if health else np.zeros(1)
    return {"capacity_rps": capacity, "offered_rps": rate, "requests": len(results), "drained_at_s": drained_at,
            "counts": {k: dict(v) for k, v in counts.items()}, "mismatched": mismatched, "lost": lost,
            "server_errors": server_errors, "resources": figures, "series": series,
            "health_ms": {"p50": float(np.percentile(h, 50)), "p99": float(np.percentile(h, 99)),
                          "max": float(h.max()), "non_200": health_failures}}


def markdown(doc: dict) -> str:
    m, r = doc["machine"], doc["result"]
    lines = [f"soak · {os.path.basename(doc['config']['model'])} · {doc['config']['duration']:.0f} s · git "
             f"{m['git_revision']}{'+dirty' if m['git_dirty'] else ''} · {m['cpu_affinity']} CPUs ({m['cpu_model']}) "
             f"· {m['time']}", "",
             f"capacity {r['capacity_rps']:.2f} req/s, offered {r['offered_rps']:.2f} req/s, {r['requests']} requests;"
             f" lost {r['lost']}, mixed/mismatched {len(r['mismatched'])}, 5xx {r['server_errors']}", "",
             "| kind | " + " | ".join(sorted({s for c in r["counts"].values() for s in c})) + " |"]
    statuses = sorted({s for c in r["counts"].values() for s in c})
    lines.append("|---|" + "---:|" * len(statuses))
    for kind, c in sorted(r["counts"].items()):
        lines.append(f"| {kind} | " + " | ".join(str(c.get(s, 0)) for s in statuses) + " |")
    lines += ["", "| resource | first | last | max | slope / min (second half) |", "|---|---:|---:|---:|---:|"]
    for key, f in r["resources"].items():
        lines.append(f"| {key} | {f['first']:.1f} | {f['last']:.1f} | {f['max']:.1f} | "
                     f"{f['slope_per_min_second_half']:+.2f} |")
    h = r["health_ms"]
    lines += ["", f"/health: p50 {h['p50']:.1f} ms, p99 {h['p99']:.1f} ms, max {h['max']:.0f} ms, "
                  f"non-200 {h['non_200']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--stage-config", default="cpu_tiny")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    ap.add_argument("--load", type=float, default=2.0, help="offered load as a multiple of the measured capacity")
    ap.add_argument("--rate", type=float, help="requests/s instead of --load x capacity")
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--name")
    args = ap.parse_args()
    result = run_against_server("soak", args, f"--served-model-name {MODEL} --max-queue {args.max_queue}",
                                lambda url, pid: soak(url, pid, args), markdown)["result"]
    return 1 if result["lost"] or result["mismatched"] or result["server_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
