"""The report of `gpu_first_run.sh`: checks, step times and the suite's table in one Markdown + one JSON + a plot.

    python benchmarks/first_run_report.py RESULT_DIR [--checks-exit N] [--suite-exit N]

Reads RESULT_DIR/checks.json (gpu_checks.py), RESULT_DIR/suite/suite.json and suite.md (gpu_suite.sh's report,
anchors beside each figure), versions.txt and gpu.txt; writes RESULT_DIR/report.md, report.json and steps.png
(talker step and decoder call times by batch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench_tts_serve import pyplot


def read(path: str) -> str | None:
    return open(path, encoding="utf-8").read().strip() if os.path.isfile(path) else None


def step_table(timings: dict) -> list[str]:
    lines = []
    for key, value in timings.items():
        if key.startswith("talker_") and key.endswith("_step_ms") and isinstance(value, dict):
            kinds = [k for k in value if k != "slots"]
            lines += ["", f"{key} (attention slots {value['slots']}), ms per step:", "",
                      "| rows | " + " | ".join(kinds) + " |", "|---:|" + "---:|" * len(kinds)]
            for rows in value[kinds[0]]:
                lines.append(f"| {rows} | " + " | ".join(f"{value[k][rows]:.2f}" for k in kinds) + " |")
        elif key.startswith("decoder_") and isinstance(value, dict):
            for kind, calls in value.items():
                lines += ["", f"{key} {kind} (rows x frames): " + ", ".join(f"{k} {v:.2f}" for k, v in calls.items())]
        else:
            lines += ["", f"{key}: {value}"]
    return lines


def plot(timings: dict, folder: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for key, value in timings.items():
        if key.startswith("talker_") and key.endswith("_step_ms") and isinstance(value, dict):
            for kind in (k for k in value if k != "slots"):
                rows = sorted(value[kind], key=int)
                left.plot([int(r) for r in rows], [value[kind][r] for r in rows], marker="o",
                          label=f"{key[7:-8]} {kind}")
        elif key.startswith("decoder_") and key.endswith("_ms") and isinstance(value, dict):
            for kind, calls in value.items():   # graphed / static / eager: {"<rows>x<frames>": ms}
                for frames in sorted({k.split("x")[1] for k in calls}, key=int):
                    points = sorted((int(k.split("x")[0]), v) for k, v in calls.items() if k.split("x")[1] == frames)
                    right.plot(*zip(*points), marker="o", label=f"{key[8:-8]} {kind} {frames} frames")
    for ax, title in ((left, "talker decode step"), (right, "decoder call")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(folder, "steps.png")
    fig.savefig(path)
    plt.close(fig)
    return os.path.basename(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--checks-exit", type=int)
    ap.add_argument("--suite-exit", type=int)
    args = ap.parse_args()
    folder = args.folder
    checks = json.loads(read(os.path.join(folder, "checks.json")) or "{}")
    suite = json.loads(read(os.path.join(folder, "suite", "suite.json")) or "null")
    timings = checks.get("timings", {})
    report = {"kind": "gpu_first_run", "version": 1, "versions": read(os.path.join(folder, "versions.txt")),
              "gpu": read(os.path.join(folder, "gpu.txt")), "checks_exit": args.checks_exit,
              "suite_exit": args.suite_exit, "checks": checks.get("checks", []), "timings": timings, "suite": suite}
    report["plot"] = plot(timings, folder)
    failed = [c for c in report["checks"] if not c["ok"]]
    lines = [f"# gpu_first_run: {report['gpu'] or 'no GPU'}", "", f"{report['versions'] or ''}", "",
             f"## Correctness: {len(report['checks']) - len(failed)} passed, {len(failed)} failed "
             f"(gpu_checks.py exit {args.checks_exit})", "", "| check | ok | figures |", "|---|---|---|"]
    for c in report["checks"]:
        figures = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("name", "ok"))
        lines.append(f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | {figures} |")
    lines += ["", "## Step times", *step_table(timings)]
    if report["plot"]:
        lines += ["", f"![step times]({report['plot']})"]
    lines += ["", f"## Serving (gpu_suite.sh exit {args.suite_exit})", ""]
    lines += [read(os.path.join(folder, "suite", "suite.md")) or "no suite report"]
    for name in (suite or {}).get("plots", []):
        lines.append(f"![{name}](suite/{name})")
    with open(os.path.join(folder, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {folder}/report.md, report.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
