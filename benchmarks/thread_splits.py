"""Serving throughput and TTFP per CPU thread split between the talker and code2wav stage processes.

    python benchmarks/thread_splits.py                                   # small preset, cpu_small, c=16 and c=1
    python benchmarks/thread_splits.py --preset tiny --base-config cpu_tiny --max-new-tokens 20 --num-prompts 4 \\
        --c1-prompts 2 --splits 1,1 default                             # a smoke run

For each split TALKER,CODE2WAV (and `default`: both stages at as many threads as this process may use, which is what
torch did before stages had a thread budget) it writes a copy of the base stage config with `threads:` set under
stages.talker and stages.code2wav, starts `omni-tts serve` on it (thread variables such as OMP_NUM_THREADS removed
from its environment), runs bench_tts_serve.py at each --concurrency (streaming pcm, the built-in prompts, seeded
sampling so every split generates the same frames), stops it, and prints one table: split, audio-s/s and TTFP
p50/p99 per level. Every bench JSON and a summary JSON/Markdown land in <result-dir>/<name>/.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import yaml

from omni_tts.config import default_stage_config_path
from bench_runner import HERE, cached_model, machine, run_bench, scrub_thread_env, served
from bench_tts_serve import write_report


def parse_split(value: str) -> tuple[str, int | None, int | None]:
    if value == "default":
        return value, None, None
    try:
        talker, code2wav = (int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a split is TALKER,CODE2WAV threads or 'default', got {value!r}")
    if talker < 1 or code2wav < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be ≥ 1, got {value!r}")
    return value, talker, code2wav


def write_stage_config(base: str, talker: int, code2wav: int, path: str) -> None:
    source = default_stage_config_path(base)
    with open(source, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config["stages"]["talker"]["threads"] = talker
    config["stages"]["code2wav"]["threads"] = code2wav
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {os.path.basename(source)} with talker {talker} / code2wav {code2wav} threads (thread_splits.py)\n")
        yaml.safe_dump(config, f, sort_keys=False)


def markdown(summary: dict) -> str:
    c = summary["config"]
    m = summary["machine"]
    head = (f"{os.path.basename(c['model'])} · {c['base_config']} · max_new_tokens {c['max_new_tokens']} · "
            f"git {m['git_revision']}{'+dirty' if m['git_dirty'] else ''} · {m['hostname']} "
            f"({m['cpu_affinity']} CPUs, {m['cpu_model']}) · {m['time']}")
    levels = [f"c={n}" for n in c["concurrency"]]
    lines = [head, "", "| split (talker/code2wav threads) | " + " | ".join(
        f"{lv} audio-s/s | {lv} TTFP p50 ms | {lv} TTFP p99 ms" for lv in levels) + " | failures |",
        "|---|" + "---:|---:|---:|" * len(levels) + "---|"]

    def ms(v):
        return "–" if v is None else f"{v * 1e3:.0f}"

    for row in summary["splits"]:
        cells, failed = [], 0
        for lv in levels:
            a = row["levels"][lv]
            failed += a["requests"] - a["ok"]
            ttfp = a["ttfp_s"]
            cells.append(f"{a['audio_seconds_per_second']:.2f} | {ms(ttfp['median'])} | {ms(ttfp['p99'])}")
        threads = f"{row['talker_threads']}/{row['code2wav_threads']}"
        label = f"torch default ({threads})" if row["split"] == "default" else threads
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {failed or '–'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the --preset random model, built on first use)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--base-config", default="cpu_small", help="stage config name or YAML path to copy")
    ap.add_argument("--splits", nargs="+", type=parse_split,
                    default=[parse_split(s) for s in ("1,1", "2,1", "1,2", "2,2", "default")])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[16, 1])
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per level with concurrency > 1")
    ap.add_argument("--c1-prompts", type=int, default=4, help="requests at concurrency 1 (they run one by one)")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", help="folder name (default: thread-splits-<model>-<UTC time>)")
    args = ap.parse_args()
    scrubbed = scrub_thread_env()
    model = args.model or cached_model(args.preset)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = args.name or f"thread-splits-{os.path.basename(os.path.normpath(model))}-{stamp}"
    out = os.path.join(args.result_dir, name)
    os.makedirs(out, exist_ok=True)
    summary = {"kind": "thread_splits", "version": 1, "name": name, "command": [sys.executable, *sys.argv],
               "config": {"model": model, "base_config": args.base_config, "concurrency": args.concurrency,
                          "num_prompts": args.num_prompts, "c1_prompts": args.c1_prompts,
                          "max_new_tokens": args.max_new_tokens, "warmups": args.warmups, "seed": args.seed},
               "machine": machine(), "scrubbed_env": scrubbed, "splits": []}
    for label, talker, code2wav in args.splits:
        talker, code2wav = talker or cpus, code2wav or cpus
        tag = f"talker{talker}-code2wav{code2wav}" + ("-default" if label == "default" else "")
        config_path = os.path.join(out, f"{tag}.yaml")
        write_stage_config(args.base_config, talker, code2wav, config_path)
        serve = ["--model", model, "--stage-config", config_path, "--served-model-name", "qwen3-tts",
                 "--max-queue", "512"]
        row = {"split": label, "talker_threads": talker, "code2wav_threads": code2wav, "stage_config": config_path,
               "levels": {}, "results": []}
        with served(serve, os.path.join(out, f"{tag}.server.log")) as url:
            for i, concurrency in enumerate(args.concurrency):
                prompts = args.c1_prompts if concurrency == 1 else args.num_prompts
                bench = ["--model", "qwen3-tts", "--voice", "ryan", "--concurrency", str(concurrency),
                         "--num-prompts", str(prompts), "--warmups", str(args.warmups if i == 0 else 0),
                         "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed), "--no-plots"]
                doc = run_bench(url, bench, out, f"{tag}-c{concurrency}")
                row["levels"][f"c={concurrency}"] = doc["levels"][0]["aggregates"]
                row["results"].append(f"{tag}-c{concurrency}.json")
        summary["splits"].append(row)
    table = markdown(summary)
    write_report(os.path.join(out, "summary"), summary, table)
    print(f"wrote {out}/summary.json and summary.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
