"""Compare two bench_tts_serve.py runs level by level.

    python benchmarks/compare_runs.py OLD.json NEW.json

Prints, for every concurrency (or request-rate) level present in both, the key aggregates of each run and the
change (absolute and %). Exits 2 when a file is unreadable or not a bench_tts_serve.py result of a known schema.
"""
from __future__ import annotations

import json
import sys

KNOWN_SCHEMAS = (1,)
KEYS = [  # (label, path into a level, scale, lower_is_better)
    ("TTFP p50 ms", ("aggregates", "ttfp_s", "median"), 1e3, True),
    ("TTFP p99 ms", ("aggregates", "ttfp_s", "p99"), 1e3, True),
    ("E2E p50 s", ("aggregates", "e2e_s", "median"), 1.0, True),
    ("RTF p50", ("aggregates", "rtf", "median"), 1.0, True),
    ("audio-s/s", ("aggregates", "audio_seconds_per_second"), 1.0, False),
    ("req/s", ("aggregates", "request_throughput"), 1.0, False),
    ("health p99 ms", ("health_ms", "p99"), 1.0, True),
]


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"compare_runs: cannot read {path}: {e}")
    if not isinstance(run, dict) or run.get("schema_version") not in KNOWN_SCHEMAS or "levels" not in run:
        raise SystemExit(f"compare_runs: {path} is not a bench_tts_serve.py result (schema {KNOWN_SCHEMAS})")
    return run


def level_key(level: dict) -> str:
    return f"c={level['concurrency']}" if level.get("concurrency") else f"rate={level.get('request_rate')}/s"


def value(level: dict, path: tuple[str, ...]) -> float | None:
    node = level
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) else None


def compare(old: dict, new: dict) -> list[str]:
    old_levels = {level_key(lv): lv for lv in old["levels"]}
    lines = []
    for level in new["levels"]:
        key = level_key(level)
        if key not in old_levels:
            continue
        lines.append(f"## {key}")
        lines.append("| metric | old | new | delta | delta % |")
        lines.append("|---|---:|---:|---:|---:|")
        for label, path, scale, _ in KEYS:
            a, b = value(old_levels[key], path), value(level, path)
            if a is None or b is None:
                lines.append(f"| {label} | {a} | {b} | – | – |")
                continue
            a, b = a * scale, b * scale
            pct = f"{(b - a) / a * 100:+.1f} %" if a else "–"
            lines.append(f"| {label} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {pct} |")
        fa = sum(old_levels[key]["aggregates"]["failures"].values())
        fb = sum(level["aggregates"]["failures"].values())
        lines.append(f"| failures | {fa} | {fb} | {fb - fa:+d} | – |")
    if not lines:
        raise SystemExit("compare_runs: the two runs share no level")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print("\n".join(compare(load(argv[0]), load(argv[1]))))
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
