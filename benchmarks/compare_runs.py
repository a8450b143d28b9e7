"""Compare two bench_tts_serve.py runs level by level (A = baseline, B = candidate).

    python benchmarks/compare_runs.py A.json B.json

For every level (c=N or rate=R/s) present in both runs, prints a Markdown table of the key aggregates of A and B and
the change B − A, absolute and in % of A, marked better/worse. Configuration differences that make the comparison
unfair (model, formats, dataset, prompts per level, ...) are listed first. Exits 2, with a message on stderr, when a
file is unreadable, is not a bench_tts_serve.py result of a known schema_version, or the runs share no level.
"""
from __future__ import annotations

import argparse
import json
import sys

KNOWN_SCHEMAS = (1, 2)      # 2 only added fields; every path below exists in both
METRICS = [  # (label, path into a level, scale, lower is better)
    ("TTFP p50 ms", ("aggregates", "ttfp_s", "median"), 1e3, True),
    ("TTFP p99 ms", ("aggregates", "ttfp_s", "p99"), 1e3, True),
    ("E2E p50 s", ("aggregates", "e2e_s", "median"), 1.0, True),
    ("RTF p50", ("aggregates", "rtf", "median"), 1.0, True),
    ("audio-s/s", ("aggregates", "audio_seconds_per_second"), 1.0, False),
    ("req/s", ("aggregates", "request_throughput"), 1.0, False),
    ("continuity %", ("aggregates", "continuity_rate"), 100.0, False),
    ("health p99 ms", ("health_ms", "p99"), 1.0, True),
]
CONFIG_KEYS = ("model", "task_type", "voice", "language", "stream_format", "response_format", "dataset",
               "num_prompts", "max_new_tokens", "ref_audio", "instructions", "extra_body", "continuity_threshold_ms")


class CompareError(Exception):
    pass


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompareError(f"cannot read {path}: {e}")
    if not isinstance(run, dict) or "schema_version" not in run or not isinstance(run.get("levels"), list):
        raise CompareError(f"{path} is not a bench_tts_serve.py result (no schema_version / levels)")
    if run["schema_version"] not in KNOWN_SCHEMAS:
        raise CompareError(f"{path} has schema_version {run['schema_version']!r}; this script reads "
                           f"{', '.join(map(str, KNOWN_SCHEMAS))}")
    for i, level in enumerate(run["levels"]):
        if not (isinstance(level, dict) and isinstance(level.get("aggregates"), dict)
                and isinstance(level["aggregates"].get("failures"), dict)
                and (level.get("concurrency") or level.get("request_rate"))):
            raise CompareError(f"{path}: level {i} is malformed (needs concurrency or request_rate, and aggregates "
                               f"with failures)")
    return run


def level_key(level: dict) -> str:
    if level.get("request_rate"):
        return f"rate={float(level['request_rate']):g}/s"
    return f"c={level['concurrency']}"


def value(level: dict, path: tuple[str, ...]) -> float | None:
    node = level
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def delta(a: float | None, b: float | None, lower_is_better: bool | None) -> dict:
    """The change from a to b: absolute, % of a (None when a is 0 or a value is missing), direction."""
    if a is None or b is None:
        return {"abs": None, "pct": None, "direction": None}
    change = b - a
    pct = change / a * 100 if a else None
    if change == 0 or lower_is_better is None:
        direction = "=" if change == 0 else None
    else:
        direction = "better" if (change < 0) == lower_is_better else "worse"
    return {"abs": change, "pct": pct, "direction": direction}


def failures(level: dict) -> int:
    return int(sum(level["aggregates"]["failures"].values()))


def config_differences(a: dict, b: dict) -> list[str]:
    ca, cb = a.get("config") or {}, b.get("config") or {}
    return [f"{k}: {ca[k]!r} → {cb[k]!r}" for k in CONFIG_KEYS if k in ca and k in cb and ca[k] != cb[k]]


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _signed(v: float | None) -> str:
    return "–" if v is None else f"{v:+.3f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1f} %"


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> list[str]:
    levels_a = {level_key(lv): lv for lv in a["levels"]}
    levels_b = {level_key(lv): lv for lv in b["levels"]}
    common = [k for k in levels_a if k in levels_b]
    if not common:
        raise CompareError(f"the runs share no level ({name_a}: {', '.join(levels_a) or 'none'}; "
                           f"{name_b}: {', '.join(levels_b) or 'none'})")
    env_a, env_b = a.get("environment") or {}, b.get("environment") or {}
    lines = [f"A = {name_a} (git {env_a.get('git_revision')}, {env_a.get('time')})",
             f"B = {name_b} (git {env_b.get('git_revision')}, {env_b.get('time')})"]
    diffs = config_differences(a, b)
    if diffs:
        lines.append("configuration differs: " + "; ".join(diffs))
    for side, mine, theirs in (("A", levels_a, levels_b), ("B", levels_b, levels_a)):
        only = [k for k in mine if k not in theirs]
        if only:
            lines.append(f"only in {side}: {', '.join(only)}")
    for key in common:
        la, lb = levels_a[key], levels_b[key]
        lines += ["", f"## {key}", "| metric | A | B | B − A | % | |", "|---|---:|---:|---:|---:|---|"]
        for label, path, scale, lower in METRICS:
            va, vb = value(la, path), value(lb, path)
            va, vb = (None if va is None else va * scale), (None if vb is None else vb * scale)
            d = delta(va, vb, lower)
            lines.append(f"| {label} | {_num(va)} | {_num(vb)} | {_signed(d['abs'])} | {_pct(d['pct'])} | "
                         f"{d['direction'] or ''} |")
        fa, fb = failures(la), failures(lb)
        d = delta(fa, fb, True)
        lines.append(f"| failures | {fa} | {fb} | {fb - fa:+d} | {_pct(d['pct'])} | {d['direction'] or ''} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", metavar="A.json", help="baseline run")
    ap.add_argument("b", metavar="B.json", help="candidate run")
    args = ap.parse_args(argv)
    try:
        lines = compare(load(args.a), load(args.b), args.a, args.b)
    except CompareError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
