"""Concurrency sweep against an omni_tts (or any OpenAI-compatible) speech server: TTFP, E2E, RTF, underrun,
audio throughput, and a /health probe during every level. Pure client: no server code is imported.

    python benchmarks/bench_tts_serve.py --base-url http://127.0.0.1:8000 --model qwen3-tts --voice ryan \
        --concurrency 1 4 16 64 --num-prompts 64

Writes <result-dir>/<run>.json (schema: docs/bench_json_schema.md), <run>.md (the table) and <run>_*.png.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_metrics import (Packet, RequestResult, WAV_HEADER_BYTES, aggregate, pcm_seconds,  # noqa: E402
                           sse_audio_seconds, summarize)

SCHEMA_VERSION = 1
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATASET = os.path.join(HERE, "datasets", "default_prompts.jsonl")


def load_dataset(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or not all(isinstance(r.get("text"), str) and r["text"] for r in rows):
        raise SystemExit(f"{path}: every line must be a JSON object with a non-empty 'text'")
    return rows


def build_payload(args: argparse.Namespace, prompt: dict, index: int) -> dict:
    payload = {"model": args.model, "input": prompt["text"], "response_format": args.response_format,
               "stream_format": args.stream_format}
    for key, value in (("voice", args.voice), ("task_type", args.task_type), ("ref_text", args.ref_text),
                       ("max_new_tokens", args.max_new_tokens)):
        if value is not None:
            payload[key] = value
    language = prompt.get("language") or args.language
    if language:
        payload["language"] = language
    if args.ref_audio_value:
        payload["ref_audio"] = args.ref_audio_value
    if args.seed is not None:
        payload["seed"] = args.seed + index
    return payload


async def one_request(session: aiohttp.ClientSession, url: str, payload: dict) -> RequestResult:
    send = time.perf_counter()
    packets: list[Packet] = []
    try:
        async with session.post(url + "/v1/audio/speech", json=payload) as response:
            if response.status != 200:
                await response.read()
                return RequestResult(send, [], time.perf_counter(), str(response.status))
            if payload["stream_format"] == "sse":
                status = await read_sse(response, packets)
            else:
                status = await read_audio(response, packets, payload["response_format"] == "wav")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return RequestResult(send, packets, time.perf_counter(), type(e).__name__)
    if status == "200" and not packets:
        status = "empty_audio"
    return RequestResult(send, packets, time.perf_counter(), status)


async def read_audio(response: aiohttp.ClientResponse, packets: list[Packet], wav: bool) -> str:
    skip = WAV_HEADER_BYTES if wav else 0
    odd = 0  # a chunk boundary may split a 16-bit sample
    async for chunk in response.content.iter_any():
        if skip:
            used = min(skip, len(chunk))
            skip -= used
            chunk = chunk[used:]
        if chunk:
            total = odd + len(chunk)
            packets.append(Packet(time.perf_counter(), pcm_seconds(total - total % 2)))
            odd = total % 2
    return "200"


async def read_sse(response: aiohttp.ClientResponse, packets: list[Packet]) -> str:
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.decode().splitlines():
                if not line.startswith("data: "):
                    continue
                seconds, event = sse_audio_seconds(line[6:])
                if seconds:
                    packets.append(Packet(time.perf_counter(), seconds))
                if event and event.get("type") == "speech.audio.error":
                    return "sse_error"
    return "200"


async def health_probe(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, interval: float,
                       latencies: list[float], failures: list[str]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
                if r.status != 200:
                    failures.append(str(r.status))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failures.append(type(e).__name__)
        latencies.append(time.perf_counter() - started)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def run_level(args: argparse.Namespace, session: aiohttp.ClientSession, prompts: list[dict],
                    concurrency: int | None, record: bool) -> dict:
    count = args.num_prompts if record else args.warmups
    semaphore = asyncio.Semaphore(concurrency or count)
    rng = random.Random(args.seed)
    done = 0

    async def job(i: int) -> RequestResult:
        nonlocal done
        async with semaphore:
            result = await one_request(session, args.base_url, build_payload(args, prompts[i % len(prompts)], i))
        done += 1
        if record:
            print(f"\r  level {concurrency or args.request_rate}: {done}/{count}", end="", file=sys.stderr, flush=True)
        return result

    stop, latencies, failures = asyncio.Event(), [], []
    probe = asyncio.create_task(health_probe(session, args.base_url, stop, 0.05, latencies, failures))
    started = time.perf_counter()
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(job(i)))
        if args.request_rate and record:
            await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    stop.set()
    await probe
    if record:
        print(file=sys.stderr)
    rows = [r.row() for r in results]
    health = summarize([x * 1e3 for x in latencies])
    return {"concurrency": concurrency, "request_rate": args.request_rate, "rows": rows,
            "aggregates": aggregate(rows, wall),
            "health_ms": dict(health, probes=len(latencies), failures=len(failures))}


def environment() -> dict:
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=HERE).stdout.strip() or None
    except OSError:
        revision = None
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "git_revision": revision,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def markdown(run: dict) -> str:
    lines = ["| level | ok/req | TTFP p50 ms | TTFP p99 ms | E2E p50 s | RTF p50 | RTF p99 | audio-s/s | req/s | "
             "stall p99 s | continuous | health p99 ms | failures |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def ms(v):
        return "–" if v is None else f"{v * 1e3:.0f}"

    def num(v, fmt="{:.2f}"):
        return "–" if v is None else fmt.format(v)

    for level in run["levels"]:
        a, h = level["aggregates"], level["health_ms"]
        name = f"c={level['concurrency']}" if level["concurrency"] else f"rate={level['request_rate']}/s"
        lines.append(f"| {name} | {a['ok']}/{a['requests']} | {ms(a['ttfp_s']['median'])} | {ms(a['ttfp_s']['p99'])} | "
                     f"{num(a['e2e_s']['median'])} | {num(a['rtf']['median'], '{:.3f}')} | {num(a['rtf']['p99'], '{:.3f}')} | "
                     f"{a['audio_seconds_per_second']:.2f} | {a['request_throughput']:.2f} | {num(a['stall_s']['p99'])} | "
                     f"{a['continuity_rate'] * 100:.0f} % | {num(h['p99'])} | {a['failures'] or '–'} |")
    return "\n".join(lines) + "\n"


def plot(run: dict, prefix: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    levels = [lv for lv in run["levels"] if lv["concurrency"]]
    if not levels:
        return []
    xs = [lv["concurrency"] for lv in levels]
    figures = {
        "ttfp": ("TTFP (ms)", [("p50", [(lv["aggregates"]["ttfp_s"]["median"] or 0) * 1e3 for lv in levels]),
                               ("p99", [(lv["aggregates"]["ttfp_s"]["p99"] or 0) * 1e3 for lv in levels])]),
        "throughput": ("audio seconds per wall second", [("audio-s/s", [lv["aggregates"]["audio_seconds_per_second"]
                                                                        for lv in levels])]),
        "rtf": ("RTF (lower is better)", [("p50", [lv["aggregates"]["rtf"]["median"] or 0 for lv in levels]),
                                          ("p99", [lv["aggregates"]["rtf"]["p99"] or 0 for lv in levels])]),
    }
    paths = []
    for name, (ylabel, series) in figures.items():
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
        for label, ys in series:
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_title(f"{run['config']['model']} — {ylabel.split(' (')[0]}")
        fig.tight_layout()
        path = f"{prefix}_{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def ref_audio_value(value: str | None) -> str | None:
    if value is None or value.startswith(("http://", "https://", "data:")):
        return value
    with open(value, "rb") as f:
        return "data:audio/wav;base64," + base64.b64encode(f.read()).decode()


async def run(args: argparse.Namespace) -> dict:
    prompts = load_dataset(args.dataset)
    random.Random(args.seed).shuffle(prompts)
    run = {"schema_version": SCHEMA_VERSION, "config": {k: v for k, v in vars(args).items() if k != "ref_audio_value"},
           "command": sys.argv, "environment": environment(), "levels": []}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=max(args.concurrency or [1]) + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if args.warmups:
            await run_level(args, session, prompts, args.warmups, record=False)
        levels = [None] if args.request_rate else args.concurrency
        for concurrency in levels:
            run["levels"].append(await run_level(args, session, prompts, concurrency, record=True))
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="qwen3-tts", help="the served model name")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--request-rate", type=float, help="Poisson arrivals (req/s) instead of fixed concurrency")
    ap.add_argument("--task-type", choices=["CustomVoice", "VoiceDesign", "Base"])
    ap.add_argument("--voice")
    ap.add_argument("--language")
    ap.add_argument("--ref-audio", help="file (sent as a data URI), http(s) URL or data URI")
    ap.add_argument("--ref-text")
    ap.add_argument("--stream-format", choices=["audio", "sse"], default="audio")
    ap.add_argument("--response-format", choices=["pcm", "wav"], default="pcm")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="JSONL with {'text', optional 'language'} per line")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, seconds")
    ap.add_argument("--result-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", help="run name (default: a timestamp)")
    args = ap.parse_args()
    if args.stream_format == "sse" and args.response_format != "pcm":
        ap.error("--stream-format sse needs --response-format pcm (durations are decoded from the PCM deltas)")
    args.base_url = args.base_url.rstrip("/")
    args.ref_audio_value = ref_audio_value(args.ref_audio)
    result = asyncio.run(run(args))
    os.makedirs(args.result_dir, exist_ok=True)
    name = args.name or datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
    prefix = os.path.join(args.result_dir, name)
    table = markdown(result)
    result["plots"] = [os.path.basename(p) for p in plot(result, prefix)]
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    print(table)
    print(f"wrote {prefix}.json, {prefix}.md and {len(result['plots'])} plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
