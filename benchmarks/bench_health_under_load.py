"""Event-loop liveness: /health latency while N streaming speech requests run.

    python benchmarks/bench_health_under_load.py --base-url http://127.0.0.1:8000 [--concurrency 64]
    python benchmarks/bench_health_under_load.py --start-server [--model DIR]   # starts `omni-tts serve` itself

Sends `--concurrency` streaming requests (pcm, stream_format=audio) at once and, until they finish, probes
/health every `--probe-interval` seconds from the same client process; prints p50/p95/p99/max probe latency,
failures, and the speech requests' outcome.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

TEXTS = ["Good morning, and welcome to the show.", "今天天气很好，我们去公园散步吧。",
         "Please hold the line, an agent will be with you shortly.", "Numbers like 42 and 2026 are read aloud."]


async def speech(session: aiohttp.ClientSession, url: str, model: str, voice: str, i: int) -> tuple[int, int]:
    payload = {"model": model, "input": TEXTS[i % len(TEXTS)], "voice": voice, "response_format": "pcm",
               "stream_format": "audio", "seed": i, "max_new_tokens": 120}
    async with session.post(url + "/v1/audio/speech", json=payload) as r:
        size = 0
        async for chunk in r.content.iter_any():
            size += len(chunk)
        return r.status, size


async def probe(session: aiohttp.ClientSession, url: str, interval: float, stop: asyncio.Event,
                latencies: list[float], failures: list[str]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            async with session.get(url + "/health") as r:
                await r.read()
                if r.status != 200:
                    failures.append(str(r.status))
        except aiohttp.ClientError as e:
            failures.append(type(e).__name__)
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(interval)


async def run(url: str, model: str, voice: str, concurrency: int, interval: float) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        stop, latencies, failures = asyncio.Event(), [], []
        prober = asyncio.create_task(probe(session, url, interval, stop, latencies, failures))
        started = time.perf_counter()
        results = await asyncio.gather(*(speech(session, url, model, voice, i) for i in range(concurrency)))
        wall = time.perf_counter() - started
        stop.set()
        await prober
    ms = np.array(latencies) * 1e3
    audio_s = sum(size for _, size in results) / 2 / 24000
    statuses = {s: sum(1 for st, _ in results if st == s) for s in {st for st, _ in results}}
    print(f"concurrency {concurrency}: {wall:.1f} s wall, {audio_s:.1f} s audio, statuses {statuses}")
    print("| probes | p50 ms | p95 ms | p99 ms | max ms | failures |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(ms)} | {np.percentile(ms, 50):.2f} | {np.percentile(ms, 95):.2f} | {np.percentile(ms, 99):.2f} | "
          f"{ms.max():.2f} | {len(failures)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url")
    ap.add_argument("--start-server", action="store_true")
    ap.add_argument("--model", help="with --start-server (default: the embedded tiny model)")
    ap.add_argument("--served-model-name", default="qwen3-tts")
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--probe-interval", type=float, default=0.01)
    args = ap.parse_args()
    server = None
    if args.start_server:
        from server_util import ServerProcess
        extra = ["--model", args.model] if args.model else []
        server = ServerProcess(*extra, "--served-model-name", args.served_model_name, "--max-queue",
                               str(max(256, args.concurrency)))
        url = server.url
    elif args.base_url:
        url = args.base_url.rstrip("/")
    else:
        ap.error("give --base-url or --start-server")
    try:
        asyncio.run(run(url, args.served_model_name, args.voice, args.concurrency, args.probe_interval))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
