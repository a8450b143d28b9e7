"""Helpers for the scripts that start `omni-tts serve` themselves and drive bench_tts_serve.py against it
(compare_reference.py, thread_splits.py): a checkpoint cache, the thread-variable scrub, a served() context, one
bench run, and the machine description recorded beside every figure. Not a command of its own.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from typing import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_tts_serve  # noqa: E402

# Variables that cap a process's OpenMP/BLAS/torch threads. The server picks its own per-stage thread counts
# (omni_tts/config/threads.py); an inherited OMP_NUM_THREADS=1 from a test shell would silently change them.
THREAD_VARIABLE = re.compile(r"^(OMP|KMP|GOMP)_|_NUM_THREADS$|^VECLIB_MAXIMUM_THREADS$|^NUMEXPR_MAX_THREADS$")


def scrub_thread_env() -> list[str]:
    """Remove the thread-capping variables from this process's environment (children inherit it); their names."""
    names = sorted(k for k in os.environ if THREAD_VARIABLE.search(k))
    for name in names:
        del os.environ[name]
    return names


def cached_model(preset: str, dtype: str = "float32", seed: int = 0) -> str:
    """The random CustomVoice checkpoint of `preset` under $OMNI_TTS_CACHE, built on first use (as cpu_suite.sh)."""
    root = os.environ.get("OMNI_TTS_CACHE", os.path.expanduser("~/.cache/omni_tts"))
    suffix = "" if dtype == "float32" else f"-{dtype}"
    path = os.path.join(root, f"{preset}-custom-voice-seed{seed}{suffix}")
    if not os.path.isfile(os.path.join(path, "speech_tokenizer", "model.safetensors")):
        subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "make-tiny-model", path, "--variant",
                        "custom_voice", "--preset", preset, "--seed", str(seed), "--dtype", dtype], check=True)
    return path


@contextlib.contextmanager
def served(serve_args: list[str], log_path: str, timeout: float = 600.0) -> Iterator[str]:
    """`omni-tts serve SERVE_ARGS` on a free port until the block ends; yields its base URL."""
    server = bench_tts_serve.Server(shlex.join(serve_args), log_path, timeout)
    print(f"starting {shlex.join(server.cmd)} (log: {log_path})", file=sys.stderr)
    try:
        asyncio.run(server.wait_healthy())
        yield server.url
    finally:
        server.stop()


def run_bench(base_url: str, args: list[str], result_dir: str, name: str) -> dict:
    """One bench_tts_serve.py run (in this process); its result document."""
    argv = ["--base-url", base_url, *args, "--result-dir", result_dir, "--name", name, "--no-progress"]
    if bench_tts_serve.main(argv) != 0:
        raise SystemExit(f"bench_tts_serve.py {shlex.join(argv)} failed")
    with open(os.path.join(result_dir, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    """Where and at which revision the figures were taken."""
    env = bench_tts_serve.environment()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"hostname": socket.gethostname(), "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
            "cpu_affinity": affinity, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch_version, "git_revision": env["git_revision"], "git_dirty": env["git_dirty"],
            "load_average": env["load_average"], "time": env["time"]}
