"""Side by side with the official reference (qwen-tts 0.1.1) in one command: same checkpoint, same texts, same
max_new_tokens, greedy decoding on both sides; audio-s/s of each and their ratios.

    python3 -m venv ~/.cache/qwen3-tts-reference/venv                   # once: the reference's side virtualenv
    ~/.cache/qwen3-tts-reference/venv/bin/pip install torch==2.13.0 transformers==4.57.3 accelerate==1.12.0 \\
        librosa soundfile einops numpy safetensors
    ~/.cache/qwen3-tts-reference/venv/bin/pip install --no-deps qwen-tts==0.1.1 dashscope==2.0.2
    python benchmarks/compare_reference.py --model ~/.cache/omni_tts/small-custom-voice-seed0 --concurrency 16 \\
        [--stage-config cpu_small] [--max-new-tokens 100] \\
        [--reference-python ~/.cache/qwen3-tts-reference/venv/bin/python]

1. omni_tts: starts `omni-tts serve --model M --stage-config S` with the thread variables (OMP_NUM_THREADS, MKL_…,
   TORCH_NUM_THREADS…) removed from its environment, so it runs with its own per-stage thread defaults; runs
   bench_tts_serve.py at `--concurrency C` (C requests unless --num-prompts, streaming pcm, warm-ups first,
   temperature 0 and subtalker_temperature 0 in every request body); stops the server. `--omni-result FILE` reads
   an earlier bench_tts_serve.py JSON instead (its level `c=C`) and skips serving.
2. The reference, in its own virtualenv (never imported here), on the texts and languages those requests sent, in
   their order: one request at a time, then all of them as one batched call; do_sample=False and
   subtalker_dosample=False; one short warm-up call of each shape first. torch threads: its own default
   (all cores) unless --reference-threads.
3. Prints one table (requests, frames, audio seconds, wall, audio-s/s, omni_tts ÷ each) and omni_tts's TTFP
   p50/p99, and writes <result-dir>/<name>.json (+ .md) with every figure, the revision and the machine.

Greedy random weights often run every request to max_new_tokens; both sides then generate the same frame counts,
which the table shows so a reader can check the comparison is like for like. Exits 2 when the reference is not
installed. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys

from bench_runner import HERE, machine, run_bench, scrub_thread_env, served  # also puts HERE on sys.path
from bench_tts_serve import DEFAULT_DATASET, load_dataset, write_report

DEFAULT_REFERENCE_PYTHON = os.path.expanduser("~/.cache/qwen3-tts-reference/venv/bin/python")
FRAME_S = 0.08                      # one 12.5 Hz codec frame = 1920 samples at 24 kHz
GREEDY = {"temperature": 0, "subtalker_temperature": 0}
WARMUP_TOKENS = 8

# Runs inside the reference virtualenv: stubs for the 25 Hz tokenizer's imports (see the reference README), then
# timed generate_custom_voice calls. Prints one JSON line.
REFERENCE_RUNNER = r'''
import importlib.machinery, json, os, sys, time, types
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for name in ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
    module = types.ModuleType(name); module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module
sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
import torch, transformers, qwen_tts
from qwen_tts import Qwen3TTSModel
args = json.loads(sys.argv[1])
if args["threads"]:
    torch.set_num_threads(args["threads"])
tts = Qwen3TTSModel.from_pretrained(args["model"], dtype=torch.float32, attn_implementation="sdpa")
texts, languages, voice = args["texts"], args["languages"], args["voice"]
greedy = dict(do_sample=False, subtalker_dosample=False)

def run(text, language, max_new_tokens):
    start = time.perf_counter()
    wavs, sr = tts.generate_custom_voice(text=text, speaker=voice if isinstance(text, str) else [voice] * len(text),
                                         language=language, max_new_tokens=max_new_tokens, **greedy)
    return time.perf_counter() - start, [len(w) / sr for w in wavs]

run(texts[0], languages[0], args["warmup_tokens"])                       # warm-ups: one of each shape
run(texts[:2], languages[:2], args["warmup_tokens"])
seconds, walls = [], []
for text, language in zip(texts, languages):
    wall, audio = run(text, language, args["max_new_tokens"])
    walls.append(wall); seconds += audio
result = {"torch": torch.__version__, "transformers": transformers.__version__,
          "qwen_tts": getattr(qwen_tts, "__version__", None), "torch_threads": torch.get_num_threads(),
          "sequential": {"wall_s": sum(walls), "audio_s": seconds, "request_wall_s": walls}}
wall, audio = run(texts, languages, args["max_new_tokens"])
result["batched"] = {"wall_s": wall, "audio_s": audio}
print(json.dumps(result))
'''


def level_of(run_doc: dict, concurrency: int, source: str) -> dict:
    for level in run_doc.get("levels", []):
        if level.get("concurrency") == concurrency:
            return level
    raise SystemExit(f"{source}: no level with concurrency {concurrency}")


def sent_prompts(run_doc: dict, level: dict) -> tuple[list[str], list[str]]:
    """The texts and languages the level's requests sent, in submission order (schema v2 records each row's dataset
    line; for v1 the line is rebuilt from bench_tts_serve.py's seeded shuffle)."""
    config = run_doc["config"]
    path = (run_doc.get("dataset") or {}).get("path") or config.get("dataset") or DEFAULT_DATASET
    prompts = load_dataset(path)
    rows = level["rows"]
    if all("prompt" in row for row in rows):
        lines = [row["prompt"] for row in rows]
    else:
        order = list(range(len(prompts)))
        random.Random(config.get("seed")).shuffle(order)
        lines = [order[i % len(order)] for i in range(len(rows))]
    texts = [prompts[i]["text"] for i in lines]
    languages = [prompts[i].get("language") or config.get("language") or "Auto" for i in lines]
    return texts, languages


def frames(audio_s: float) -> int:
    return round(audio_s / FRAME_S)


def omni_figures(run_doc: dict, level: dict, source: str) -> dict:
    a = level["aggregates"]
    ok_rows = [r for r in level["rows"] if r["status"] == "200"]
    body = run_doc["config"].get("extra_body") or {}
    return {"result_json": source, "concurrency": level["concurrency"], "requests": a["requests"], "ok": a["ok"],
            "failures": a["failures"], "greedy": body.get("temperature") == 0,
            "max_new_tokens": run_doc["config"].get("max_new_tokens"),
            "frames": sum(frames(r["audio_s"]) for r in ok_rows),
            "request_frames": [frames(r["audio_s"]) for r in level["rows"]],
            "audio_s": a["audio_seconds"], "wall_s": a["wall_s"],
            "audio_s_per_s": a["audio_seconds_per_second"],
            "ttfp_p50_s": a["ttfp_s"]["median"], "ttfp_p99_s": a["ttfp_s"]["p99"],
            "environment": run_doc.get("environment")}


def reference_figures(r: dict) -> dict:
    audio = r["audio_s"]
    return {"requests": len(audio), "frames": sum(frames(s) for s in audio),
            "request_frames": [frames(s) for s in audio], "audio_s": sum(audio), "wall_s": r["wall_s"],
            "audio_s_per_s": sum(audio) / r["wall_s"]}


def run_omni(args: argparse.Namespace, name: str) -> tuple[dict, str]:
    serve = ["--model", args.model, "--stage-config", args.stage_config, "--served-model-name", "qwen3-tts",
             "--max-queue", str(max(512, args.num_prompts))]
    bench = ["--model", "qwen3-tts", "--voice", args.voice, "--concurrency", str(args.concurrency),
             "--num-prompts", str(args.num_prompts), "--warmups", str(args.warmups), "--max-new-tokens",
             str(args.max_new_tokens), "--seed", str(args.seed), "--dataset", args.dataset,
             "--stream-format", "audio", "--response-format", "pcm", "--extra-body", json.dumps(GREEDY), "--no-plots"]
    bench_name = name + "-omni"
    with served(serve, os.path.join(args.result_dir, bench_name + ".server.log")) as url:
        doc = run_bench(url, bench, args.result_dir, bench_name)
    return doc, os.path.join(args.result_dir, bench_name + ".json")


def run_reference(args: argparse.Namespace, texts: list[str], languages: list[str]) -> dict:
    payload = json.dumps({"model": os.path.abspath(os.path.expanduser(args.model)), "texts": texts,
                          "languages": languages, "voice": args.voice, "max_new_tokens": args.max_new_tokens,
                          "threads": args.reference_threads, "warmup_tokens": WARMUP_TOKENS})
    print(f"reference: {len(texts)} requests one at a time, then one batched call ({args.reference_python})",
          file=sys.stderr)
    proc = subprocess.run([args.reference_python, "-c", REFERENCE_RUNNER, payload], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compare_reference: the reference run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(doc: dict) -> str:
    omni, ref, c = doc["omni"], doc["reference"], doc["omni"]["concurrency"]
    rows = [(f"omni_tts, {c} concurrent streaming requests over HTTP", omni),
            (f"reference, one batched call of {ref['batched']['requests']}", ref["batched"]),
            ("reference, one request at a time", ref["sequential"])]
    m = doc["machine"]
    lines = [f"{os.path.basename(doc['config']['model'])} · greedy both sides · max_new_tokens "
             f"{doc['config']['max_new_tokens']} · git {m['git_revision']}{'+dirty' if m['git_dirty'] else ''} · "
             f"{m['hostname']} ({m['cpu_affinity']} CPUs, {m['cpu_model']}) · {m['time']}", "",
             "| system | requests | frames | audio s | wall s | audio-s/s | omni_tts ÷ it |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows:
        lines.append(f"| {label} | {r.get('ok', r['requests'])}/{r['requests']} | {r['frames']} | "
                     f"{r['audio_s']:.1f} | {r['wall_s']:.1f} | {r['audio_s_per_s']:.2f} | "
                     f"{omni['audio_s_per_s'] / r['audio_s_per_s']:.2f}× |")
    ttfp = [omni["ttfp_p50_s"], omni["ttfp_p99_s"]]
    lines += ["", "omni_tts TTFP at c=%d: p50 %s ms, p99 %s ms" % (c, *("–" if t is None else f"{t * 1e3:.0f}"
                                                                       for t in ttfp)),
              f"reference torch threads: {ref['torch_threads']}; omni_tts server: its own per-stage defaults "
              f"(thread variables removed: {', '.join(doc['scrubbed_env']) or 'none were set'})"]
    same = omni["request_frames"] == ref["sequential"]["request_frames"] == ref["batched"]["request_frames"]
    lines.append("frames per request: " + ("identical on all three" if same else
                 f"differ (omni {omni['request_frames']}, sequential {ref['sequential']['request_frames']}, "
                 f"batched {ref['batched']['request_frames']})"))
    if not omni["greedy"]:
        lines.append("warning: the omni_tts result was not taken with temperature 0")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a CustomVoice checkpoint directory both sides can load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, help="requests (default: --concurrency, one batched call's worth)")
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--warmups", type=int, default=2, help="omni_tts warm-up requests before the measured level")
    ap.add_argument("--seed", type=int, default=0, help="bench_tts_serve.py's prompt shuffle")
    ap.add_argument("--stage-config", default="cpu_small")
    ap.add_argument("--dataset", default=DEFAULT_DATASET)
    ap.add_argument("--reference-python", default=DEFAULT_REFERENCE_PYTHON)
    ap.add_argument("--reference-threads", type=int, help="torch threads of the reference (default: torch's own)")
    ap.add_argument("--omni-result", help="read omni_tts's figures from this bench_tts_serve.py JSON (level c=C) "
                                          "instead of serving")
    ap.add_argument("--result-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", help="file name stem (default: compare-reference-<model>-c<C>-<UTC time>)")
    args = ap.parse_args()
    args.num_prompts = args.num_prompts or args.concurrency
    probe = [args.reference_python, "-c",
             "import importlib.util, sys; sys.exit(importlib.util.find_spec('qwen_tts') is None)"]
    if not os.path.isfile(args.reference_python) or subprocess.run(probe).returncode != 0:
        print(f"compare_reference: the reference (qwen-tts) is not installed for {args.reference_python}; set up "
              "its virtualenv as this script's docstring shows (or pass --reference-python)", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    model_name = os.path.basename(os.path.normpath(args.model))
    name = args.name or f"compare-reference-{model_name}-c{args.concurrency}-{stamp}"
    os.makedirs(args.result_dir, exist_ok=True)
    scrubbed = scrub_thread_env()                    # for the server and the reference alike
    if args.omni_result:
        with open(args.omni_result, encoding="utf-8") as f:
            run_doc, source = json.load(f), args.omni_result
    else:
        run_doc, source = run_omni(args, name)
    level = level_of(run_doc, args.concurrency, source)
    omni = omni_figures(run_doc, level, source)
    if omni["max_new_tokens"] not in (None, args.max_new_tokens):
        print(f"warning: {source} ran with max_new_tokens {omni['max_new_tokens']}, the reference runs with "
              f"{args.max_new_tokens}", file=sys.stderr)
    texts, languages = sent_prompts(run_doc, level)
    ref = run_reference(args, texts, languages)
    doc = {"kind": "compare_reference", "version": 1, "name": name, "command": [sys.executable, *sys.argv],
           "config": {k: v for k, v in vars(args).items()}, "machine": machine(), "scrubbed_env": scrubbed,
           "texts": texts, "languages": languages, "omni": omni,
           "reference": {"torch": ref["torch"], "transformers": ref["transformers"], "qwen_tts": ref["qwen_tts"],
                         "torch_threads": ref["torch_threads"], "greedy": True,
                         "sequential": reference_figures(ref["sequential"]) | {
                             "request_wall_s": ref["sequential"]["request_wall_s"]},
                         "batched": reference_figures(ref["batched"])}}
    doc["ratios"] = {"omni_vs_batched": omni["audio_s_per_s"] / doc["reference"]["batched"]["audio_s_per_s"],
                     "omni_vs_sequential": omni["audio_s_per_s"] / doc["reference"]["sequential"]["audio_s_per_s"]}
    table = markdown(doc)
    prefix = os.path.join(args.result_dir, name)
    write_report(prefix, doc, table)
    print(f"wrote {prefix}.json and {prefix}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
