#!/usr/bin/env bash
# The first run on a GPU machine, one command: correctness on the device first, then the suite, then one report.
#
#   bash benchmarks/gpu_first_run.sh             # CUDA: gpu_checks.py (goldens in fp32, graphed == eager talker and
#                                                #   decoder in bf16, per-bucket step times), then gpu_suite.sh
#   CPU=1 bash benchmarks/gpu_first_run.sh       # the same three steps on the CPU (tiny model, SMOKE=1 suite)
#
# A fresh GPU machine has torch (>= 2.11) but maybe not our other dependencies. Carry them as wheels in .whl/
# (Python 3.12, manylinux x86-64; ~3 MiB): msgspec, pyzmq, soundfile + cffi + pycparser, soxr; everything else
# we import at serving time (aiohttp, numpy, safetensors, tokenizers, huggingface_hub, pyyaml, prometheus_client)
# is usual in a CUDA image. `av` is needed only for mp3/opus/aac/flac responses and speed != 1, which the suite
# does not ask for. Missing imports are installed from WHEELS (default .whl) into a private folder.
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     msgspec pyzmq soundfile soxr cffi pycparser
#
# Settings (environment): RESULT_DIR (default benchmarks/results/gpu-first-run-<UTC time>); PRESETS (default
# "0.6b 1.7b"); CHECK_PRESET (gpu_checks.py's real-size model; default the first of PRESETS); DTYPE (bfloat16);
# STAGE_CONFIGS (default "qwen3_tts_1gpu qwen3_tts_1gpu_fused": both one-GPU layouts, measured side by side);
# VARIANTS (default custom_voice; "base" adds the saved-voice clone tables); DEADLINE_S (default 530: levels of the
# suite that would start after it are skipped, so the report is written within 9 minutes); CHECKS=0 skips step 1
# (a rerun after the checks passed); every gpu_suite.sh setting passes through (CONCURRENCY, RATES, ...).
# One 9-minute call does not hold every table: run 1.7B with both layouts first (PRESETS=1.7b), then 0.6B and Base.
# Output: RESULT_DIR/{checks.json, checks.log, report.md, report.json, suite/ (gpu_suite.sh's folder + plots)}.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
stamp=$(date -u +%Y%m%dT%H%M%SZ)
out=${RESULT_DIR:-benchmarks/results/gpu-first-run-$stamp}
mkdir -p "$out"
py=$(command -v python3 || command -v python)
export PYTHONUNBUFFERED=1

# --- dependencies -------------------------------------------------------------------------------------------------
missing=$("$py" - <<'EOF'
import importlib.util
names = ["msgspec", "zmq", "soundfile", "soxr", "aiohttp", "numpy", "safetensors", "tokenizers", "huggingface_hub",
         "yaml", "prometheus_client"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  wheels=${WHEELS:-.whl}
  echo "[first_run] missing: $missing; installing from $wheels" >&2
  ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "[first_run] no wheels in $wheels (see the header)" >&2; exit 1; }
  site=${TMPDIR:-/tmp}/omni-tts-site
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
    || exit 1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
# the repository itself; `python` and `omni-tts` on the PATH are this interpreter (a machine's plain `python` may
# be another one, without the packages)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
bin=${TMPDIR:-/tmp}/omni-tts-bin
mkdir -p "$bin"
printf '#!/bin/sh\nexec %s -m omni_tts.entrypoints.cli "$@"\n' "$py" > "$bin/omni-tts"
printf '#!/bin/sh\nexec %s "$@"\n' "$py" > "$bin/python"   # not a link: a venv is found from the path run
chmod +x "$bin/python" "$bin/omni-tts"
export PATH=$bin:$PATH

if [ "${CPU:-0}" = 1 ]; then
  device=cpu
  : "${PRESETS:=tiny}" "${DTYPE:=float32}" "${STAGE_CONFIGS:=cpu_tiny}"
  export SMOKE=1
else
  device=cuda
  : "${PRESETS:=0.6b 1.7b}" "${DTYPE:=bfloat16}" "${STAGE_CONFIGS:=qwen3_tts_1gpu qwen3_tts_1gpu_fused}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>/dev/null || true
fi
export PRESETS DTYPE STAGE_CONFIGS
"$py" -c 'import sys, torch; print(f"[first_run] python {sys.version.split()[0]}, torch {torch.__version__}, cuda \
{torch.version.cuda}, devices {torch.cuda.device_count()}")' | tee "$out/versions.txt"

# --- 1. correctness -----------------------------------------------------------------------------------------------
cache=${OMNI_TTS_CACHE:-$HOME/.cache/omni_tts}
first=${CHECK_PRESET:-${PRESETS%% *}}
model_args=()
if [ "$first" != tiny ]; then
  model=$cache/$first-custom-voice-seed0$([ "$DTYPE" = float32 ] || echo "-$DTYPE")   # as gpu_suite.sh names it
  [ -f "$model/speech_tokenizer/model.safetensors" ] || \
    omni-tts make-tiny-model "$model" --variant custom_voice --preset "$first" --seed 0 --dtype "$DTYPE"
  model_args=(--model "$model")
fi
t=$SECONDS
if [ "${CHECKS:-1}" = 0 ]; then
  echo '{"checks": [], "timings": {}}' > "$out/checks.json"
  checks_rc=0
else
  "$py" benchmarks/gpu_checks.py --device "$device" --dtype "$DTYPE" --out "$out" "${model_args[@]}" 2>&1 \
    | tee "$out/checks.log"
  checks_rc=${PIPESTATUS[0]}
fi
echo "[first_run] checks: exit $checks_rc, $((SECONDS - t)) s" >&2

# --- 2. the suite -------------------------------------------------------------------------------------------------
t=$SECONDS
DEADLINE_EPOCH=$(( $(date +%s) + ${DEADLINE_S:-530} - (SECONDS - started) )) RESULT_DIR="$out/suite" bash benchmarks/gpu_suite.sh
suite_rc=$?
echo "[first_run] suite: exit $suite_rc, $((SECONDS - t)) s" >&2

# --- 3. the report ------------------------------------------------------------------------------------------------
"$py" benchmarks/first_run_report.py "$out" --checks-exit "$checks_rc" --suite-exit "$suite_rc"
echo "[first_run] done in $((SECONDS - started)) s: $out/report.md" >&2
[ "$checks_rc" = 0 ] && [ "$suite_rc" = 0 ]
