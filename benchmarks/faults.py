"""Fault injection under load: kill -9 and SIGSTOP each stage process, measure detection and recovery.

    python benchmarks/faults.py                      # the embedded tiny model, cpu_tiny, 4 streams of load

Starts `omni-tts serve` on a free loopback port and keeps --concurrency greedy streaming requests running. For each
stage (talker, code2wav) and each fault (SIGKILL, SIGSTOP) it waits until the server is healthy and loaded, injects
the fault, and polls /health every 20 ms: detection = fault → first non-200, recovery = fault → first 200 after it.
It counts the requests in flight at the fault and how each ended (an error within how long, or completed), and
after recovery checks one greedy request against its offline synthesis. Writes <result-dir>/<name>.json and .md.
Exit status 1 when a fault was not recovered from or a request after recovery differs.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import aiohttp

from bench_runner import HERE
from server_probe import Outcome, Speech, expected_pcm, matches, run_against_server, stage_pids, stream_speech

MODEL = "faults"
LOAD = Speech("A sentence that runs for a while, so that faults find it in flight.", "ryan", 300)
CHECK = Speech("Good morning, everyone.", "vivian", 40)
FAULTS = [(stage, sig) for sig in ("SIGKILL", "SIGSTOP") for stage in ("talker", "code2wav")]


async def wait_for_health(session: aiohttp.ClientSession, url: str, healthy: bool, timeout: float) -> float | None:
    """Seconds until /health is (or is not) 200, polling every 20 ms; None on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if (r.status == 200) == healthy:
                    return time.monotonic() - started
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.02)
    return None


async def inject(session: aiohttp.ClientSession, url: str, server_pid: int, stage: str, sig: str,
                 concurrency: int, timeout: float) -> dict:
    await wait_for_health(session, url, True, timeout)
    # repetition_penalty 1: the random weights then run to the token limit (past the fault) instead of an early end
    load = [asyncio.create_task(stream_speech(session, url, LOAD.body(MODEL, repetition_penalty=1.0)))
            for _ in range(concurrency)]
    await asyncio.sleep(1.5)  # every stream past its first audio
    pid = stage_pids(server_pid)[stage]
    faulted_at = time.monotonic()
    os.kill(pid, getattr(signal, sig))
    detected = await wait_for_health(session, url, False, timeout)
    recovered = await wait_for_health(session, url, True, timeout)
    outcomes: list[Outcome] = await asyncio.gather(*load)
    failed = [o for o in outcomes if not o.complete]
    return {"stage": stage, "signal": sig, "in_flight": len(outcomes), "failed": len(failed),
            "completed": len(outcomes) - len(failed),
            "failed_within_s": max((o.ended - faulted_at for o in failed), default=None),
            "detection_s": detected, "recovery_s": None if recovered is None else detected + recovered,
            "old_process_gone": not os.path.exists(f"/proc/{pid}") or _zombie(pid)}


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def run(url: str, server_pid: int, args: argparse.Namespace) -> dict:
    expected = expected_pcm(args.model, [CHECK])[CHECK]
    rows = []
    async with aiohttp.ClientSession() as session:
        for stage, sig in FAULTS:
            row = await inject(session, url, server_pid, stage, sig, args.concurrency, args.timeout)
            check = await stream_speech(session, url, CHECK.body(MODEL))
            row["after_recovery_equal"] = check.status == 200 and check.complete and matches(check.pcm, expected)
            rows.append(row)
            print(row, file=sys.stderr)
    return {"faults": rows}


def markdown(doc: dict) -> str:
    m = doc["machine"]

    def s(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    lines = [f"faults · {os.path.basename(doc['config']['model'])} · heartbeat timeout "
             f"{doc['config']['heartbeat_timeout']:g} s · git {m['git_revision']}{'+dirty' if m['git_dirty'] else ''}"
             f" · {m['cpu_affinity']} CPUs ({m['cpu_model']}) · {m['time']}", "",
             "| stage | fault | in flight | failed | completed | failed within s | detected s | healthy again s | "
             "old process gone | greedy request after = offline |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["result"]["faults"]:
        lines.append(f"| {r['stage']} | {r['signal']} | {r['in_flight']} | {r['failed']} | {r['completed']} | "
                     f"{s(r['failed_within_s'])} | {s(r['detection_s'])} | {s(r['recovery_s'])} | "
                     f"{'yes' if r['old_process_gone'] else 'NO'} | {'yes' if r['after_recovery_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--stage-config", default="cpu_tiny")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the server's --stage-heartbeat-timeout")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for detection or recovery")
    ap.add_argument("--result-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--name")
    args = ap.parse_args()
    doc = run_against_server("faults", args, f"--served-model-name {MODEL} --stage-heartbeat-timeout "
                             f"{args.heartbeat_timeout} --max-restarts 10",
                             lambda url, pid: run(url, pid, args), markdown)
    result = doc["result"]
    bad = [r for r in result["faults"] if r["recovery_s"] is None or not r["after_recovery_equal"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
