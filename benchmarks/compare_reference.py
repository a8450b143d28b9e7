"""Side by side with the official reference (qwen-tts 0.1.1): same texts, same random weights, audio-s/s.

    bash ../shared/tools/qwen3_tts_reference/setup_reference_env.sh            # once: the side virtualenv
    omni-tts make-tiny-model /tmp/small-cv --variant custom_voice --preset small --dtype float32
    bash benchmarks/cpu_suite.sh                       # omni_tts on the same checkpoint: benchmarks/results/*.json
    python benchmarks/compare_reference.py --model ~/.cache/omni_tts/small-custom-voice-seed0 --concurrency 16 \
        --omni-result benchmarks/results/<run>.json [--reference-python ~/.cache/qwen3-tts-reference/venv/bin/python]

Runs the reference twice in its own virtualenv (never imported here): one request at a time, and all texts as one
batched call (same texts as bench_tts_serve.py's default set, same voice and max_new_tokens, checkpoint sampling
defaults); reads omni_tts's audio-s/s at the same concurrency from the bench_tts_serve.py JSON; prints both and
the ratio. Exits 2 with a clear message when the reference is not installed. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULT_REFERENCE_PYTHON = os.path.expanduser("~/.cache/qwen3-tts-reference/venv/bin/python")
HERE = os.path.dirname(os.path.abspath(__file__))

# Runs inside the reference virtualenv: stubs for the 25 Hz tokenizer's imports (see the reference README), then
# timed generate_custom_voice calls. Prints one JSON line.
REFERENCE_RUNNER = r'''
import importlib.machinery, json, os, sys, time, types
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for name in ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
    module = types.ModuleType(name); module.__spec__ = importlib.machinery.ModuleSpec(name, None); sys.modules[name] = module
sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
import torch
from qwen_tts import Qwen3TTSModel
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
tts = Qwen3TTSModel.from_pretrained(args["model"], dtype=torch.float32, attn_implementation="sdpa")
texts, voice = args["texts"], args["voice"]
kw = dict(max_new_tokens=args["max_new_tokens"], language="Auto")
tts.generate_custom_voice(text=texts[0], speaker=voice, **kw)  # warm-up
result = {}
start = time.perf_counter(); audio = 0.0
for text in texts:
    wavs, sr = tts.generate_custom_voice(text=text, speaker=voice, **kw)
    audio += len(wavs[0]) / sr
result["sequential"] = {"wall_s": time.perf_counter() - start, "audio_s": audio}
start = time.perf_counter()
wavs, sr = tts.generate_custom_voice(text=texts, speaker=[voice] * len(texts), **dict(kw, language=["Auto"] * len(texts)))
result["batched"] = {"wall_s": time.perf_counter() - start, "audio_s": sum(len(w) / sr for w in wavs)}
print(json.dumps(result))
'''


def load_texts(path: str, count: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return (texts * (count // max(len(texts), 1) + 1))[:count]


def omni_audio_per_second(result_path: str, concurrency: int) -> float:
    with open(result_path, encoding="utf-8") as f:
        run = json.load(f)
    for level in run.get("levels", []):
        if level.get("concurrency") == concurrency:
            return float(level["aggregates"]["audio_seconds_per_second"])
    raise SystemExit(f"{result_path}: no level with concurrency {concurrency}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a CustomVoice checkpoint directory both sides can load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dataset", default=os.path.join(HERE, "datasets", "default_prompts.jsonl"))
    ap.add_argument("--reference-python", default=DEFAULT_REFERENCE_PYTHON)
    ap.add_argument("--omni-result", required=True, help="a bench_tts_serve.py JSON with the same concurrency level")
    args = ap.parse_args()
    probe = [args.reference_python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('qwen_tts') is None)"]
    if not os.path.isfile(args.reference_python) or subprocess.run(probe).returncode != 0:
        print(f"compare_reference: the reference (qwen-tts) is not installed for {args.reference_python}; run "
              "../shared/tools/qwen3_tts_reference/setup_reference_env.sh first (or pass --reference-python)",
              file=sys.stderr)
        return 2
    texts = load_texts(args.dataset, args.concurrency)
    payload = json.dumps({"model": args.model, "texts": texts, "voice": args.voice,
                          "max_new_tokens": args.max_new_tokens, "threads": args.threads})
    proc = subprocess.run([args.reference_python, "-c", REFERENCE_RUNNER, payload], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"compare_reference: the reference run failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return 1
    reference = json.loads(proc.stdout.strip().splitlines()[-1])
    omni = omni_audio_per_second(args.omni_result, args.concurrency)
    rows = [("reference, one request at a time", reference["sequential"]),
            (f"reference, one batched call of {len(texts)}", reference["batched"])]
    print(f"| system | audio-s/s | vs omni_tts at concurrency {args.concurrency} |")
    print("|---|---:|---:|")
    for name, r in rows:
        rate = r["audio_s"] / r["wall_s"]
        print(f"| {name} | {rate:.2f} | omni_tts is {omni / rate:.2f}× |")
    print(f"| omni_tts, concurrency {args.concurrency} | {omni:.2f} | 1.00× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
