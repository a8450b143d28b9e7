"""What soak.py and faults.py both need: a served model started on loopback, the expected (offline, greedy) audio of
a request, one streamed speech request with its outcome, and the server's resources (RSS, open fds, /dev/shm)
read from /proc. Not a command of its own.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp
import numpy as np

from bench_runner import machine, scrub_thread_env
from bench_tts_serve import Server, write_report

SHM_DIR = "/dev/shm"
PCM_BYTES_PER_SAMPLE = 2


@dataclass(frozen=True)
class Speech:
    """One greedy request: what is sent and what identifies its expected audio."""
    text: str
    voice: str
    max_new_tokens: int

    def body(self, model: str, **extra: object) -> dict:
        return {"model": model, "input": self.text, "voice": self.voice, "temperature": 0,
                "max_new_tokens": self.max_new_tokens, **extra}


def expected_pcm(model_dir: str, speeches: list[Speech]) -> dict[Speech, np.ndarray]:
    """The offline synthesis of each distinct request (one torch thread: the server owns the cores), as int16."""
    import torch

    from omni_tts.audio.pcm import to_int16
    from omni_tts.engine.offline import synthesize
    from omni_tts.models.qwen3_tts.model import Qwen3TTS
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.sampling import SamplingParams

    torch.set_num_threads(1)
    tts = Qwen3TTS.from_pretrained(model_dir)
    out = {}
    for speech in dict.fromkeys(speeches):
        request = SynthesisRequest(text=speech.text, voice=speech.voice,
                                   sampling=SamplingParams(temperature=0, max_new_tokens=speech.max_new_tokens))
        out[speech] = to_int16(synthesize(tts, [request])[0].audio)
    return out


def matches(pcm: bytes, expected: np.ndarray) -> bool:
    """Same length and within one int16 step per sample (streamed float audio equals offline to ~1e-6)."""
    got = np.frombuffer(pcm, "<i2")
    return got.shape == expected.shape and int(np.abs(got.astype(np.int32) - expected).max(initial=0)) <= 1


@dataclass
class Outcome:
    status: int | str            # HTTP status, or "error: …" when the connection failed
    pcm: bytes = b""
    complete: bool = False       # the body ended properly (chunked terminator / full length)
    started: float = 0.0
    ended: float = 0.0


async def stream_speech(session: aiohttp.ClientSession, url: str, body: dict, *, read_delay: float = 0.0,
                        disconnect_after: int | None = None, timeout: float = 300.0) -> Outcome:
    """POST a streaming pcm request and read it all (sleeping `read_delay` between 4 KiB reads: a slow client),
    or hang up after `disconnect_after` bytes."""
    outcome = Outcome(status="error", started=time.monotonic())
    try:
        async with session.post(url + "/v1/audio/speech", json=dict(body, stream_format="audio", response_format="pcm"),
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            outcome.status = r.status
            chunks = []
            async for data in r.content.iter_chunked(4096):
                chunks.append(data)
                if disconnect_after is not None and sum(map(len, chunks)) >= disconnect_after:
                    r.close()
                    break
                if read_delay:
                    await asyncio.sleep(read_delay)
            else:
                outcome.complete = True
            outcome.pcm = b"".join(chunks)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        outcome.status = f"error: {type(e).__name__}"
    outcome.ended = time.monotonic()
    return outcome


def process_tree(root_pid: int) -> list[int]:
    """root_pid and its descendants (the server, its stages, its resource tracker)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def resources(root_pid: int) -> dict[str, float]:
    """RSS (MiB) and open fds summed over the server's processes, and its /dev/shm segments' bytes (MiB)."""
    rss_kib = fds = 0
    for pid in process_tree(root_pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                rss_kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    prefix = f"omni_tts_{root_pid}_"  # the owner's pid is in its segments' names
    shm = sum(os.path.getsize(os.path.join(SHM_DIR, n)) for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    return {"rss_mib": rss_kib / 1024, "fds": fds, "shm_mib": shm / 2**20}


def slope_per_minute(times: list[float], values: list[float]) -> float:
    """Least-squares slope of values over time, per minute (0 for fewer than 3 samples)."""
    if len(times) < 3:
        return 0.0
    return float(np.polyfit(np.asarray(times) - times[0], np.asarray(values, dtype=float), 1)[0] * 60)


async def health_latency(session: aiohttp.ClientSession, url: str) -> tuple[int | None, float]:
    started = time.monotonic()
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            await r.read()
            return r.status, time.monotonic() - started
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None, time.monotonic() - started


def stage_pids(server_pid: int) -> dict[str, int]:
    """The server's stage processes by stage name (each names itself omni-tts-<stage>, cut to 15 characters)."""
    found = {}
    for pid in process_tree(server_pid)[1:]:
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        for stage in ("talker", "code2wav"):
            if comm == f"omni-tts-{stage}"[:15]:
                found[stage] = pid
    return found


def run_against_server(kind: str, args: argparse.Namespace, serve_flags: str,
                       work: Callable[[str, int], Awaitable[dict]], markdown: Callable[[dict], str]) -> dict:
    """Start `omni-tts serve --model args.model --stage-config args.stage_config SERVE_FLAGS` on loopback, run
    `work(url, server_pid)`, stop the server, and write <result-dir>/<name>.json/.md; the document."""
    scrub_thread_env()
    if args.model is None:
        from omni_tts.models.qwen3_tts.random_model import default_model_dir
        args.model = default_model_dir()
    name = args.name or f"{kind}-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    os.makedirs(args.result_dir, exist_ok=True)
    server = Server(f"--model {args.model} --stage-config {args.stage_config} {serve_flags}",
                    os.path.join(args.result_dir, name + ".server.log"), 300)
    try:
        asyncio.run(server.wait_healthy())
        result = asyncio.run(work(server.url, server.proc.pid))
    finally:
        server.stop()
    doc = {"kind": kind, "version": 1, "command": [sys.executable, *sys.argv], "machine": machine(),
           "config": {k: v for k, v in vars(args).items() if k not in ("result_dir", "name")}, "result": result}
    write_report(os.path.join(args.result_dir, name), doc, markdown(doc))
    return doc
