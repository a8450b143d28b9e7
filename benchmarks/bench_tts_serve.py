"""Load sweep against an omni_tts (or any OpenAI-compatible) speech server: TTFP, E2E, RTF, underrun/continuity,
request and audio throughput, and a /health probe every 50 ms during every level (event-loop liveness).
A pure HTTP client: no server code is imported.

    python benchmarks/bench_tts_serve.py --base-url http://127.0.0.1:8000 --model qwen3-tts --voice ryan \\
        --concurrency 1 4 16 64 --num-prompts 64

    # Poisson arrivals at 0.5 and 1 req/s instead of fixed concurrency; SSE; voice clone from a local file
    python benchmarks/bench_tts_serve.py --model qwen3-tts --request-rate 0.5 1 --stream-format sse \\
        --task-type Base --ref-audio ref.wav --ref-text "transcript of ref.wav"

Writes <result-dir>/<name>.json (schema: docs/bench_json_schema.md), <name>.md (the table, also printed) and
<name>_{ttfp,throughput,rtf}.png. Compare two runs with benchmarks/compare_runs.py.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import mimetypes
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_metrics import (CONTINUITY_THRESHOLD_S, AudioByteCounter, Packet, RequestResult,  # noqa: E402
                           SSEParser, aggregate, health_figures, parse_sse_event)

SCHEMA_VERSION = 2
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATASET = os.path.join(HERE, "datasets", "default_prompts.jsonl")
ERROR_CHARS = 300


# --- inputs -------------------------------------------------------------------------------------------------------
def load_dataset(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{number}: not JSON ({e})")
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
                raise SystemExit(f"{path}:{number}: every line must be a JSON object with a non-empty 'text'")
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    return rows


def ref_audio_value(value: str | None) -> str | None:
    """URLs and data URIs pass through; a local file becomes a base64 data URI."""
    if value is None or re.match(r"^(https?|file|data):", value):
        return value
    if not os.path.isfile(value):
        raise SystemExit(f"--ref-audio {value}: no such file (and not an http(s)/file/data URI)")
    mime = mimetypes.guess_type(value)[0] or "audio/wav"
    mime = "audio/wav" if mime == "audio/x-wav" else mime
    with open(value, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode("ascii")


def build_payload(args: argparse.Namespace, prompt: dict, index: int) -> dict:
    payload = dict(args.extra_body_value)
    payload.update({"model": args.model, "input": prompt["text"], "response_format": args.response_format,
                    "stream_format": args.stream_format})
    for key, value in (("voice", args.voice), ("task_type", args.task_type), ("ref_text", args.ref_text),
                       ("instructions", args.instructions), ("max_new_tokens", args.max_new_tokens),
                       ("ref_audio", args.ref_audio_value)):
        if value is not None:
            payload[key] = value
    language = prompt.get("language") or args.language
    if language:
        payload["language"] = language
    if args.seed is not None:
        payload["seed"] = args.seed + index
    return payload


# --- one request --------------------------------------------------------------------------------------------------
async def one_request(session: aiohttp.ClientSession, base_url: str, payload: dict, meta: dict) -> RequestResult:
    send = time.perf_counter()
    result = RequestResult(send, [], send, "200", meta=meta)
    counter = AudioByteCounter(payload["response_format"])
    try:
        async with session.post(base_url + "/v1/audio/speech", json=payload) as response:
            if response.status != 200:
                result.status = str(response.status)
                result.error = _error_message(await response.read())
            elif payload["stream_format"] == "sse":
                await read_sse(response, result, counter)
            else:
                async for chunk in response.content.iter_any():
                    seconds = counter.feed(len(chunk))
                    if seconds > 0:
                        result.packets.append(Packet(time.perf_counter(), seconds))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure is a counted status, never a crashed run
        result.status = type(e).__name__
        result.error = str(e)[:ERROR_CHARS] or None
    result.end = time.perf_counter()
    result.total_bytes = counter.total_bytes
    if result.ok and not result.packets:
        result.status, result.error = "empty_audio", f"200 with {counter.total_bytes} bytes and no audio samples"
    return result


async def read_sse(response: aiohttp.ClientResponse, result: RequestResult, counter: AudioByteCounter) -> None:
    parser = SSEParser()
    done = False
    chunks = response.content.iter_any()
    while True:
        chunk = await anext(chunks, None)
        datas = parser.feed(chunk) if chunk is not None else parser.finish()
        for data in datas:
            kind, audio, event = parse_sse_event(data)
            if kind == "speech.audio.delta":
                seconds = counter.feed(len(audio))
                if seconds > 0:
                    result.packets.append(Packet(time.perf_counter(), seconds))
            elif kind == "speech.audio.done":
                done, result.usage = True, event.get("usage")
            elif kind == "speech.audio.error":
                result.status = "sse_error"
                result.error = _error_message(json.dumps(event).encode())
                return
        if chunk is None:
            break
    if not done:
        result.status = "sse_no_done"
        result.error = "the event stream ended without speech.audio.done"


def _error_message(body: bytes) -> str:
    """The OpenAI error envelope's message, else the body's start."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    if message is None:
        message = body[:ERROR_CHARS].decode("utf-8", errors="replace")
    return str(message)[:ERROR_CHARS]


# --- a level ------------------------------------------------------------------------------------------------------
async def health_probe(session: aiohttp.ClientSession, base_url: str, stop: asyncio.Event, interval: float,
                       latencies: list[float], failures: list[str]) -> None:
    """GET /health every `interval` s (start to start) until stopped; latency of every probe, failures by status."""
    next_start = time.perf_counter()
    while not stop.is_set():
        started = time.perf_counter()
        try:
            async with session.get(base_url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
                if r.status != 200:
                    failures.append(str(r.status))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            failures.append(type(e).__name__)
        latencies.append(time.perf_counter() - started)
        next_start = max(next_start + interval, time.perf_counter())
        try:
            await asyncio.wait_for(stop.wait(), next_start - time.perf_counter())
        except asyncio.TimeoutError:
            pass


class Progress:
    """tqdm when installed, else a counter on stderr."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled, self.done, self.failed = total, label, enabled, 0, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed)
        elif self.enabled:
            print(f"\r{self.label}: {self.done}/{self.total}" + (f" ({self.failed} failed)" if self.failed else ""),
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


async def run_requests(args: argparse.Namespace, session: aiohttp.ClientSession, prompts: list[dict], count: int,
                       concurrency: int | None, rate: float | None, label: str,
                       progress: bool) -> tuple[list[RequestResult], float, float]:
    """count requests, at most `concurrency` in flight, sent at Poisson times when `rate` is set.
    Returns (results in submission order, start, wall seconds from the first send to the last completion)."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(args.seed)
    bar = Progress(count, label, progress)

    async def job(i: int) -> RequestResult:
        prompt = prompts[i % len(prompts)]
        payload = build_payload(args, prompt, i)
        meta = {"index": i, "prompt": prompt.get("_index", i % len(prompts)), "chars": len(prompt["text"]),
                "language": payload.get("language")}
        if semaphore is None:
            result = await one_request(session, args.base_url, payload, meta)
        else:
            async with semaphore:
                result = await one_request(session, args.base_url, payload, meta)
        bar.update(result.ok)
        return result

    start = time.perf_counter()
    next_send, tasks = start, []
    for i in range(count):
        if rate and i:
            next_send += rng.expovariate(rate)          # Poisson process: exponential gaps
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(job(i)))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        bar.close()
    return list(results), start, time.perf_counter() - start


async def run_level(args: argparse.Namespace, session: aiohttp.ClientSession, probe_session: aiohttp.ClientSession,
                    prompts: list[dict], concurrency: int | None, rate: float | None) -> dict:
    label = f"c={concurrency}" if rate is None else f"rate={rate:g}/s"
    stop, latencies, failures = asyncio.Event(), [], []
    probe = None
    if args.health_interval_ms > 0:
        probe = asyncio.create_task(health_probe(probe_session, args.base_url, stop, args.health_interval_ms / 1e3,
                                                 latencies, failures))
    started_at = _utc_now()
    results, start, wall = await run_requests(args, session, prompts, args.num_prompts, concurrency, rate, label,
                                              not args.no_progress)
    stop.set()
    if probe is not None:
        await probe
    threshold = args.continuity_threshold_ms / 1e3
    rows = [r.row(threshold, origin=start, with_packets=args.save_timelines) for r in results]
    return {"label": label, "concurrency": concurrency if rate is None else None, "request_rate": rate,
            "max_concurrency": concurrency if rate is not None else None, "started_at": started_at,
            "aggregates": aggregate(rows, wall),
            "health_ms": health_figures(latencies, failures, args.health_interval_ms / 1e3) if probe else None,
            "rows": rows}


# --- environment, server ------------------------------------------------------------------------------------------
def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=HERE, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment() -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "aiohttp": aiohttp.__version__, "numpy": np.__version__,
            "git_revision": _git("rev-parse", "--short", "HEAD"),
            "git_dirty": None if status is None else bool(status), "load_average": load, "time": _utc_now()}


class Server:
    """--start-server: `omni-tts serve` as a child process (its own process group), logs to a file."""

    def __init__(self, extra: str, log_path: str, timeout: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), *shlex.split(extra)]
        self.log_path, self.timeout = log_path, timeout
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise SystemExit(f"server exited with {self.proc.returncode}; log: {self.log_path}")
                try:
                    async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.5)
        raise SystemExit(f"server not healthy after {self.timeout:.0f} s; log: {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server (it stops its stage processes); then anything left in the process group we
        created for it is terminated, killed after a grace period."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)            # anyone left in the group?
                except ProcessLookupError:
                    self.log.close()
                    return
                time.sleep(0.2)
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
        self.log.close()


async def check_health(base_url: str) -> None:
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(base_url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    raise SystemExit(f"{base_url}/health answered {r.status}: the server is not ready")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise SystemExit(f"cannot reach {base_url}/health: {type(e).__name__}: {e}")


# --- the run ------------------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, run_doc: dict) -> None:
    prompts = load_dataset(args.dataset)
    for i, p in enumerate(prompts):
        p["_index"] = i                                  # the dataset line, recorded in each row
    random.Random(args.seed).shuffle(prompts)
    await check_health(args.base_url)
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=30)
    # limit=0: no client-side connection cap, so only the level's own limit queues requests
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as probe_session:
        if args.warmups:
            warm = min(args.warmups, max(args.concurrency))
            results, _, wall = await run_requests(args, session, prompts, args.warmups, warm, None, "warm-up",
                                                  not args.no_progress)
            bad = [r.status for r in results if not r.ok]
            run_doc["warmup"] = {"requests": len(results), "failed": len(bad), "wall_s": wall}
            if bad:
                print(f"warning: {len(bad)}/{len(results)} warm-up requests failed: {sorted(set(bad))}; first "
                      f"error: {next(r.error for r in results if not r.ok)}", file=sys.stderr)
        if args.request_rate:
            plan = [(args.max_concurrency, rate) for rate in args.request_rate]
        else:
            plan = [(c, None) for c in args.concurrency]
        for concurrency, rate in plan:
            run_doc["levels"].append(await run_level(args, session, probe_session, prompts, concurrency, rate))


def markdown(run_doc: dict) -> str:
    c, env = run_doc["config"], run_doc["environment"]
    head = (f"**{c['model']}** at {c['base_url']} · {c['stream_format']}/{c['response_format']} · "
            f"{c['num_prompts']} prompts per level ({os.path.basename(c['dataset'])}) · max_new_tokens "
            f"{c['max_new_tokens']} · git {env['git_revision']}{'+dirty' if env.get('git_dirty') else ''} · "
            f"{env['hostname']} ({env['cpu_count']} CPUs) · {env['time']}")
    lines = [head, "",
             "| level | ok/req | TTFP p50 ms | TTFP p99 ms | E2E p50 s | RTF p50 | RTF p99 | audio-s/s | req/s | "
             "stall p99 s | continuous | health p50/p99/max ms | failures |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def fmt(v, spec=".2f", scale=1.0):
        return "–" if v is None else format(v * scale, spec)

    for level in run_doc["levels"]:
        a, h = level["aggregates"], level["health_ms"]
        health = "–" if not h else f"{fmt(h['median'], '.1f')}/{fmt(h['p99'], '.1f')}/{fmt(h['max'], '.0f')}"
        if h and h["failures"]:
            health += f" ({h['failures']} failed)"
        failures = ", ".join(f"{k}×{v}" for k, v in a["failures"].items()) or "–"
        lines.append(f"| {level['label']} | {a['ok']}/{a['requests']} | {fmt(a['ttfp_s']['median'], '.0f', 1e3)} | "
                     f"{fmt(a['ttfp_s']['p99'], '.0f', 1e3)} | {fmt(a['e2e_s']['median'])} | "
                     f"{fmt(a['rtf']['median'], '.3f')} | {fmt(a['rtf']['p99'], '.3f')} | "
                     f"{a['audio_seconds_per_second']:.2f} | {a['request_throughput']:.2f} | "
                     f"{fmt(a['stall_s']['p99'])} | {a['continuity_rate'] * 100:.0f} % | {health} | {failures} |")
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (said on stderr) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return None
    return plt


def write_report(prefix: str, doc: dict, table: str) -> None:
    """prefix.json (the whole document) and prefix.md (its Markdown table); the table is printed too."""
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    print(table)


def plot(run_doc: dict, prefix: str) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    levels = run_doc["levels"]
    if not levels:
        return []
    by_rate = levels[0]["request_rate"] is not None
    xs = [lv["request_rate"] if by_rate else lv["concurrency"] for lv in levels]
    xlabel = "request rate (req/s, Poisson)" if by_rate else "concurrency (requests in flight)"

    def series(metric: str, stat: str, scale: float = 1.0) -> list[float]:
        return [np.nan if lv["aggregates"][metric][stat] is None else lv["aggregates"][metric][stat] * scale
                for lv in levels]

    c = run_doc["config"]
    subtitle = (f"{c['model']} · {c['stream_format']}/{c['response_format']} · {c['num_prompts']} req/level · "
                f"git {run_doc['environment']['git_revision']}")
    figures = {
        "ttfp": ("time to first audio packet", "TTFP (ms)",
                 [("p50", series("ttfp_s", "median", 1e3)), ("p99", series("ttfp_s", "p99", 1e3))], None),
        "throughput": ("audio throughput", "audio seconds per wall second",
                       [("audio-s/s", [lv["aggregates"]["audio_seconds_per_second"] for lv in levels])], None),
        "rtf": ("real-time factor (E2E / audio duration)", "RTF (lower is better)",
                [("p50", series("rtf", "median")), ("p99", series("rtf", "p99"))], 1.0),
    }
    paths = []
    for name, (title, ylabel, lines, hline) in figures.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        for n, (label, ys) in enumerate(lines):
            ax.plot(xs, ys, marker="o", label=label)
            below = n == 0 and len(lines) > 1           # p50 labels under the points, p99 labels over them
            for x, y in zip(xs, ys):
                if np.isfinite(y):
                    ax.annotate(f"{y:,.0f}" if abs(y) >= 100 else f"{y:.3g}", (x, y), textcoords="offset points",
                                xytext=(0, -13 if below else 6), ha="center", fontsize=8)
        if hline is not None:
            ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label="real time (RTF 1)")
        values = [y for _, ys in lines for y in ys if np.isfinite(y) and y > 0]
        if values and max(values) / min(values) > 30:     # wide range: log scale keeps the low levels legible
            ax.set_yscale("log")
            ax.set_ylim(min(values + [hline or np.inf]) / 2, max(values) * 2)
        else:
            ax.set_ylim(0, ax.get_ylim()[1] * 1.1)         # room for the value labels
        if not by_rate and len(set(xs)) > 1:
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_title(f"{title}\n{subtitle}", fontsize=10)
        fig.tight_layout()
        path = f"{prefix}_{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default="qwen3-tts", help="the served model name sent as `model`")
    g.add_argument("--start-server", metavar="ARGS",
                   help="start `omni-tts serve ARGS` on a free port for the run and stop it after "
                        "(e.g. \"--model tests/fixtures/qwen3_tts/tiny-custom-voice --served-model-name qwen3-tts\")")
    g.add_argument("--server-start-timeout", type=float, default=300.0)
    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="sweep: one level per value, at most that many requests in flight")
    g.add_argument("--request-rate", type=float, nargs="+",
                   help="Poisson arrivals at R req/s (one level per value) instead of fixed concurrency")
    g.add_argument("--max-concurrency", type=int, help="with --request-rate: cap on requests in flight")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    g.add_argument("--warmups", type=int, default=3, help="requests before the first level, not recorded")
    g.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, seconds")
    g = ap.add_argument_group("request")
    g.add_argument("--dataset", default=DEFAULT_DATASET, help="JSONL: {\"text\": ..., optional \"language\"} a line")
    g.add_argument("--task-type", choices=["CustomVoice", "VoiceDesign", "Base"])
    g.add_argument("--voice")
    g.add_argument("--language", help="when a prompt has none")
    g.add_argument("--instructions", help="style instruction (required by VoiceDesign)")
    g.add_argument("--ref-audio", help="voice clone reference: local file (sent as a data URI), URL or data URI")
    g.add_argument("--ref-text", help="transcript of --ref-audio")
    g.add_argument("--stream-format", choices=["audio", "sse"], default="audio")
    g.add_argument("--response-format", choices=["pcm", "wav"], default="pcm")
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--seed", type=int, default=0,
                   help="shuffles the prompts, draws the arrivals; request i is sent seed+i")
    g.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    g = ap.add_argument_group("measurement and output")
    g.add_argument("--continuity-threshold-ms", type=float, default=CONTINUITY_THRESHOLD_S * 1e3)
    g.add_argument("--health-interval-ms", type=float, default=50.0, help="0 disables the /health probe")
    g.add_argument("--save-timelines", action="store_true", help="keep every packet's [offset_s, audio_s] per row")
    g.add_argument("--result-dir", default=os.path.join(HERE, "results"))
    g.add_argument("--name", help="file name stem (default: <model>-<stream>-<format>-<UTC time>)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or args.num_prompts < 1 or args.warmups < 0:
        ap.error("--concurrency and --num-prompts must be ≥ 1, --warmups ≥ 0")
    if args.request_rate and min(args.request_rate) <= 0:
        ap.error("--request-rate must be > 0")
    try:
        args.extra_body_value = json.loads(args.extra_body)
    except ValueError:
        args.extra_body_value = None
    if not isinstance(args.extra_body_value, dict):
        ap.error("--extra-body must be a JSON object")
    args.base_url = args.base_url.rstrip("/")
    args.ref_audio_value = ref_audio_value(args.ref_audio)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = args.name or re.sub(r"[^A-Za-z0-9._-]+", "_",
                               f"{args.model}-{args.stream_format}-{args.response_format}-{stamp}")
    os.makedirs(args.result_dir, exist_ok=True)
    prefix = os.path.join(args.result_dir, name)
    config = {k: v for k, v in vars(args).items() if k not in ("ref_audio_value", "extra_body_value")}
    config["extra_body"] = args.extra_body_value
    run_doc = {"schema_version": SCHEMA_VERSION, "name": name, "config": config,
               "command": [sys.executable, *sys.argv] if argv is None else ["bench_tts_serve.py", *argv],
               "environment": environment(), "dataset": {"path": args.dataset}, "warmup": None, "levels": []}
    run_doc["command_line"] = shlex.join(run_doc["command"])
    server = None
    try:
        if args.start_server is not None:
            server = Server(args.start_server, prefix + ".server.log", args.server_start_timeout)
            print(f"starting {shlex.join(server.cmd)} (log: {server.log_path})", file=sys.stderr)
            asyncio.run(server.wait_healthy())
            args.base_url = config["base_url"] = server.url
        run_doc["dataset"]["prompts"] = len(load_dataset(args.dataset))
        asyncio.run(run(args, run_doc))
    except KeyboardInterrupt:
        print("interrupted: writing the levels finished so far", file=sys.stderr)
    except SystemExit as e:
        if not run_doc["levels"]:
            print(f"bench_tts_serve: {e}", file=sys.stderr)
            return 1
        raise
    finally:
        if server is not None:
            server.stop()
    if not run_doc["levels"]:
        return 1
    table = markdown(run_doc)
    run_doc["plots"] = [] if args.no_plots else [os.path.basename(p) for p in plot(run_doc, prefix)]
    write_report(prefix, run_doc, table)
    print(f"wrote {prefix}.json, {prefix}.md and {len(run_doc['plots'])} plots", file=sys.stderr)
    failed = sum(lv["aggregates"]["requests"] - lv["aggregates"]["ok"] for lv in run_doc["levels"])
    if failed:
        print(f"{failed} requests failed (counted by status in the table)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
