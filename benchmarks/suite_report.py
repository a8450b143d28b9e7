"""Summary of a suite folder written by benchmarks/gpu_suite.sh: one table, one JSON, two plots.

    python benchmarks/suite_report.py benchmarks/results/gpu-suite-<time> [--title TEXT]

Reads every bench_tts_serve.py result named `<preset>-c<N>.json` or `<preset>-rate<R>.json` in the folder (one level
each), the GPU samples beside it (`<same name>.gpu.csv`: `nvidia-smi --query-gpu=timestamp,utilization.gpu,
memory.used --format=csv,noheader,nounits -lms 200`, local time), `phases.tsv` (seconds per build / start / level)
and `gpu.txt` (`nvidia-smi --query-gpu=name,driver_version,memory.total`). Writes suite.json, suite.md,
suite_concurrency.png and suite_rate.png in the folder.

GPU utilisation is nvidia-smi's: the share of each sample period in which any kernel ran, not how busy the SMs were.
Samples count from the level's first request to its last completion when the timestamps allow (±1 s), else over the
whole bench_tts_serve.py run.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import re
import sys

from bench_runner import machine
from bench_tts_serve import pyplot, write_report

# The marks to beat (issue 22), printed beside our figure: sglang-omni's CI and Nari's server on one H100 80 GB
# (1.7B CustomVoice, Poisson arrivals over Seed-TTS EN), vllm-omni's model runner V2 on one H200 (1.7B Base);
# and our targets on one H100/H200 (1.7B CustomVoice bf16, Poisson arrivals over the default prompts).
ANCHORS = {
    ("rate", 1.0): "sglang-omni TTFP p50 21 ms · target p95 ≤ 30 ms",
    ("rate", 10.0): "target p95 ≤ 30 ms",
    ("rate", 20.0): "sglang-omni p95 47-49 ms, 0 % stall > 50 ms; Nari p95 38.0 ms, 0.17-0.77 % underrun · "
                    "target p95 ≤ 40 ms, ≤ 0.5 % underrun",
    ("concurrency", 64): "vllm-omni 89.2 audio-s/s (H200, 1.7B Base) · target ≥ 300 audio-s/s, p50 ≤ 250 ms",
}


# Base voice clones (levels named <preset>-base…): sglang-omni's CI on one H100 80 GB (1.7B Base) and vllm-omni's
BASE_ANCHORS = {
    ("rate", 20.0): "sglang-omni 1.7B Base voice clone p95 174-185 ms",
    ("concurrency", 64): "vllm-omni 89.2 audio-s/s (H200, 1.7B Base)",
}


def anchor(row: dict) -> str:
    key = ("rate", float(row["request_rate"])) if row["request_rate"] is not None else ("concurrency",
                                                                                        row["concurrency"])
    return (BASE_ANCHORS if "-base" in row["preset"] else ANCHORS).get(key, "")


NAME = re.compile(r"^(?P<preset>.+)-(?:c(?P<c>\d+)|rate(?P<rate>[0-9.]+))$")


def gpu_samples(path: str, start: datetime.datetime | None, wall_s: float) -> dict | None:
    """Mean/max utilisation and memory over the samples inside [start, start + wall_s] (UTC), or all of them."""
    if not os.path.isfile(path):
        return None
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").astimezone(datetime.timezone.utc)
                rows.append((when, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
    if start is not None:
        end = start + datetime.timedelta(seconds=wall_s + 1)
        inside = [r for r in rows if start <= r[0] <= end]
        window = "level" if inside else "run"
        rows = inside or rows
    else:
        window = "run"
    if not rows:
        return {"samples": 0, "window": window}
    util, mem = [r[1] for r in rows], [r[2] for r in rows]
    return {"samples": len(rows), "window": window, "util_mean_pct": sum(util) / len(util), "util_max_pct": max(util),
            "mem_used_mean_mib": sum(mem) / len(mem), "mem_used_max_mib": max(mem)}


def level_row(path: str) -> dict | None:
    stem = os.path.basename(path)[:-len(".json")]
    match = NAME.match(stem)
    if not match:
        return None
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not doc.get("levels"):
        return None
    level = doc["levels"][0]
    a = level["aggregates"]
    ok_rows = [r for r in level["rows"] if r["status"] == "200"]
    try:
        start = datetime.datetime.fromisoformat(level["started_at"])
    except (KeyError, ValueError):
        start = None
    return {"preset": match["preset"], "label": level["label"], "concurrency": level["concurrency"],
            "request_rate": level["request_rate"], "result": os.path.basename(path),
            "requests": a["requests"], "ok": a["ok"], "failures": a["failures"], "wall_s": a["wall_s"],
            "ttfp_ms": {k: None if a["ttfp_s"][k] is None else a["ttfp_s"][k] * 1e3 for k in ("median", "p95", "p99")},
            "audio_s_per_s": a["audio_seconds_per_second"], "request_throughput": a["request_throughput"],
            "rtf": {k: a["rtf"][k] for k in ("median", "p99")}, "e2e_p50_s": a["e2e_s"]["median"],
            "underrun_requests": sum(1 for r in ok_rows if r.get("stalls", 0) > 0),
            "stall_p99_s": a["stall_s"]["p99"], "continuity_rate": a["continuity_rate"],
            "gpu": gpu_samples(path[:-len(".json")] + ".gpu.csv", start, a["wall_s"]),
            "max_new_tokens": doc["config"].get("max_new_tokens"), "git_revision": doc["environment"]["git_revision"]}


def markdown(summary: dict) -> str:
    def f(v, spec=".0f"):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    lines = [summary["title"], "",
             "| model | level | ok/req | TTFP p50 / p95 / p99 ms | audio-s/s | RTF p50 / p99 | underrun req | "
             "stall p99 s | GPU util mean / max % | GPU mem max MiB | anchor / target |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in summary["levels"]:
        t, g = r["ttfp_ms"], r["gpu"] or {}
        lines.append(f"| {r['preset']} | {r['label']} | {r['ok']}/{r['requests']} | {f(t['median'])} / {f(t['p95'])} / "
                     f"{f(t['p99'])} | {r['audio_s_per_s']:.2f} | {f(r['rtf']['median'], '.3f')} / "
                     f"{f(r['rtf']['p99'], '.3f')} | {r['underrun_requests']}/{r['ok']} | "
                     f"{f(r['stall_p99_s'], '.2f')} | "
                     f"{f(g.get('util_mean_pct'))} / {f(g.get('util_max_pct'))} | {f(g.get('mem_used_max_mib'))} | "
                     f"{anchor(r)} |")
    if summary["phases"]:
        lines += ["", "time per phase: " + ", ".join(f"{p['preset']} {p['phase']} {p['seconds']:.0f} s"
                                                      for p in summary["phases"])
                  + f" (total {sum(p['seconds'] for p in summary['phases']):.0f} s)"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, folder: str) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    for kind, key, xlabel in (("concurrency", "concurrency", "concurrency (requests in flight)"),
                              ("rate", "request_rate", "request rate (req/s, Poisson)")):
        levels = [r for r in summary["levels"] if r[key] is not None]
        if not levels:
            continue
        panels = [("TTFP p50 (ms)", lambda r: r["ttfp_ms"]["median"]), ("TTFP p99 (ms)", lambda r: r["ttfp_ms"]["p99"]),
                  ("audio seconds per wall second", lambda r: r["audio_s_per_s"]),
                  ("GPU utilisation, mean (%)", lambda r: (r["gpu"] or {}).get("util_mean_pct"))]
        fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=110)
        for ax, (ylabel, value) in zip(axes.flat, panels):
            for preset in dict.fromkeys(r["preset"] for r in levels):
                points = sorted((r[key], value(r)) for r in levels if r["preset"] == preset)
                xs = [x for x, y in points if y is not None]
                ys = [y for x, y in points if y is not None]
                if xs:
                    ax.plot(xs, ys, marker="o", label=preset)
            if kind == "concurrency":
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            xs = sorted({r[key] for r in levels})
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend()
        fig.suptitle(summary["title"], fontsize=9)
        fig.tight_layout()
        path = os.path.join(folder, f"suite_{kind}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(os.path.basename(path))
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--title", help="first line of the Markdown (default: the folder name)")
    ap.add_argument("--config", default="{}", help="JSON object of the suite's settings, recorded as is")
    args = ap.parse_args()
    levels = [row for path in sorted(glob.glob(os.path.join(args.folder, "*.json")))
              if not path.endswith("suite.json") and (row := level_row(path)) is not None]
    order = {p: i for i, p in enumerate(dict.fromkeys(r["preset"] for r in levels))}
    levels.sort(key=lambda r: (order[r["preset"]], r["request_rate"] is not None, r["concurrency"] or 0,
                               r["request_rate"] or 0))
    phases = []
    if os.path.isfile(os.path.join(args.folder, "phases.tsv")):
        with open(os.path.join(args.folder, "phases.tsv"), encoding="utf-8") as f:
            for line in f:
                preset, phase, seconds = line.rstrip("\n").split("\t")
                phases.append({"preset": preset, "phase": phase, "seconds": float(seconds)})
    gpu = None
    if os.path.isfile(os.path.join(args.folder, "gpu.txt")):
        with open(os.path.join(args.folder, "gpu.txt"), encoding="utf-8") as f:
            gpu = f.read().strip() or None
    m = machine()
    title = args.title or os.path.basename(os.path.normpath(args.folder))
    title += (f" · git {m['git_revision']}{'+dirty' if m['git_dirty'] else ''} · {m['hostname']} · "
              f"{gpu or 'no GPU (nvidia-smi absent)'}")
    summary = {"kind": "gpu_suite", "version": 1, "title": title, "config": json.loads(args.config), "gpu": gpu,
               "machine": m, "phases": phases, "levels": levels}
    summary["plots"] = plot(summary, args.folder)
    table = markdown(summary)
    write_report(os.path.join(args.folder, "suite"), summary, table)
    print(f"wrote {args.folder}/suite.json, suite.md and {len(summary['plots'])} plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
