#!/usr/bin/env bash
# GPU suite: random-weight 0.6B and 1.7B checkpoints (bf16), CustomVoice (voice ryan) and/or Base (a saved voice
# clone: a reference clip with its text, uploaded once), each served on each stage config named (omni_tts/
# stage_configs/: qwen3_tts_1gpu, two processes, and qwen3_tts_1gpu_fused, one); bench_tts_serve.py at concurrency
# 1/8/32/64 and at Poisson arrivals of 1/10/20 req/s; GPU utilisation and memory sampled by nvidia-smi every 200 ms
# during each level. The defaults (0.6B and 1.7B CustomVoice, two processes) ran in 282 s on an H200 with shorter
# levels (docs/benchmarks.md). Results: benchmarks/results/gpu-suite-<UTC time>/ — one bench JSON (+ .md, .gpu.csv)
# per level, named <preset>[-base][-fused]-c<N> / -rate<R>, server logs, and suite.json / suite.md /
# suite_{concurrency,rate}.png from benchmarks/suite_report.py.
#
#   bash benchmarks/gpu_suite.sh
#   SMOKE=1 bash benchmarks/gpu_suite.sh          # the same logic on a CPU: tiny preset, cpu_tiny, short levels
#
# Settings (environment; SMOKE=1 changes the defaults in brackets):
#   PRESETS="0.6b 1.7b" [tiny]   DTYPE=bfloat16 [float32]   VARIANTS=custom_voice (and/or base)
#   STAGE_CONFIGS=qwen3_tts_1gpu [cpu_tiny] (several: each is served and measured; a name ending in _fused, or
#   connector kind local, marks its levels -fused)
#   CONCURRENCY="1 8 32 64" [1 4]   RATES="1 10 20" [2]   MAX_NEW_TOKENS=120 [20]   WARMUPS=4 [2]
#   MIN_PROMPTS=4 [2]: requests per level at least; a concurrency level sends max(MIN_PROMPTS, 2 × c)
#   RATE_SECONDS=12 [2], RATE_MAX_PROMPTS=48 [4]: a rate level sends
#     clamp(rate × RATE_SECONDS, MIN_PROMPTS, RATE_MAX_PROMPTS) requests
# phases.tsv / the report's last line give the seconds of every build, start and level: trim the levels there if a
# run goes over budget.
#   RESULT_DIR (default benchmarks/results/gpu-suite-<time>), GPU_INDEX=0, SERVER_TIMEOUT=900 (s)
#   NVIDIA_SMI=1 [0]: 1 = required; 0 = sample only when nvidia-smi is present
#   DEADLINE_EPOCH (unset): a preset or level that would start after this time (seconds since the epoch) is skipped
#     and named in phases.tsv, so a caller with a time limit still gets its report
# Thread variables (OMP_NUM_THREADS, MKL_NUM_THREADS, TORCH_NUM_THREADS…) are removed: the server picks its own.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${SMOKE:-0}" = 1 ]; then
  : "${PRESETS:=tiny}" "${DTYPE:=float32}" "${STAGE_CONFIGS:=cpu_tiny}" "${CONCURRENCY:=1 4}" "${RATES:=2}"
  : "${MAX_NEW_TOKENS:=20}" "${WARMUPS:=2}" "${MIN_PROMPTS:=2}" "${RATE_SECONDS:=2}" "${RATE_MAX_PROMPTS:=4}"
  : "${NVIDIA_SMI:=0}"
fi
: "${PRESETS:=0.6b 1.7b}" "${DTYPE:=bfloat16}" "${STAGE_CONFIGS:=qwen3_tts_1gpu}" "${CONCURRENCY:=1 8 32 64}"
: "${RATES:=1 10 20}" "${MAX_NEW_TOKENS:=120}" "${WARMUPS:=4}" "${MIN_PROMPTS:=4}" "${RATE_SECONDS:=12}"
: "${RATE_MAX_PROMPTS:=48}" "${NVIDIA_SMI:=1}" "${GPU_INDEX:=0}" "${SERVER_TIMEOUT:=900}" "${VARIANTS:=custom_voice}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
out=${RESULT_DIR:-benchmarks/results/gpu-suite-$stamp}
cache=${OMNI_TTS_CACHE:-$HOME/.cache/omni_tts}
mkdir -p "$out"
unset $(compgen -e | grep -E '^(OMP|KMP|GOMP)_|_NUM_THREADS$|^VECLIB_MAXIMUM_THREADS$|^NUMEXPR_MAX_THREADS$') || true

have_smi=0
if command -v nvidia-smi >/dev/null 2>&1; then
  have_smi=1
  nvidia-smi -i "$GPU_INDEX" --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
elif [ "$NVIDIA_SMI" = 1 ]; then
  echo "gpu_suite: nvidia-smi not found (SMOKE=1 or NVIDIA_SMI=0 runs without it)" >&2; exit 1
fi

server="" sampler=""
cleanup() {
  [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || true; }
  [ -n "$server" ] && { kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; }
  sampler="" server=""
}
trap cleanup EXIT
past_deadline() { [ -n "${DEADLINE_EPOCH:-}" ] && [ "$(date +%s)" -ge "$DEADLINE_EPOCH" ]; }
phase() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$out/phases.tsv"; echo "[gpu_suite] $1 $2: $3 s" >&2; }

bench() {  # bench NAME ARGS...: one bench_tts_serve.py run, GPU sampled into NAME.gpu.csv
  local name=$1; shift
  if [ "$have_smi" = 1 ]; then
    nvidia-smi -i "$GPU_INDEX" --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
      -lms 200 > "$out/$name.gpu.csv" &
    sampler=$!
  fi
  python benchmarks/bench_tts_serve.py --base-url "http://127.0.0.1:$port" --model qwen3-tts --voice "$voice" \
    --max-new-tokens "$MAX_NEW_TOKENS" --seed 0 --result-dir "$out" --name "$name" --no-plots --no-progress "$@"
  if [ -n "$sampler" ]; then kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || true; sampler=""; fi
}

# a Base voice's reference: 3 s of a gliding tone (random weights make any clip as good a voice as another)
ref_clip=$out/reference.wav
python - "$ref_clip" <<'PY'
import sys, wave
import numpy as np
t = np.arange(3 * 24000) / 24000
pcm = (0.3 * np.sin(2 * np.pi * (150 + 40 * t) * t) * 32767).astype("<i2")
with wave.open(sys.argv[1], "wb") as f:
    f.setnchannels(1); f.setsampwidth(2); f.setframerate(24000); f.writeframes(pcm.tobytes())
PY

for preset in $PRESETS; do
 for variant in $VARIANTS; do
  if past_deadline; then phase "$preset-$variant" skipped 0; continue; fi
  t=$SECONDS
  suffix=$([ "$variant" = custom_voice ] || echo "-${variant//_/-}")   # cpu_suite.sh's names: custom-voice → no suffix
  model=$cache/$preset-${variant//_/-}-seed0$([ "$DTYPE" = float32 ] || echo "-$DTYPE")   # as cpu_suite.sh names it
  [ -f "$model/speech_tokenizer/model.safetensors" ] || \
    omni-tts make-tiny-model "$model" --variant "$variant" --preset "$preset" --seed 0 --dtype "$DTYPE"
  phase "$preset$suffix" build $((SECONDS - t))
  for stage_config in $STAGE_CONFIGS; do
    layout=$(python -c 'import sys; from omni_tts.config import load_stage_config
print("-fused" if load_stage_config(sys.argv[1]).connector.kind == "local" else "")' "$stage_config")
    run=$preset$suffix$layout
    if past_deadline; then phase "$run" skipped 0; continue; fi
    t=$SECONDS
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    omni-tts serve --model "$model" --stage-config "$stage_config" --served-model-name qwen3-tts --port "$port" \
      --max-queue 1024 --voices-dir "$out/voices-$run" > "$out/$run.server.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      kill -0 "$server" 2>/dev/null || { echo "server exited; log: $out/$run.server.log" >&2; exit 1; }
      [ $((SECONDS - t)) -lt "$SERVER_TIMEOUT" ] || { echo "server not healthy after $SERVER_TIMEOUT s" >&2; exit 1; }
      sleep 1
    done
    voice=ryan
    if [ "$variant" = base ]; then  # a saved voice: its clone prompt is computed once, as users of a clone do
      voice=suite_clone
      curl -sf -o /dev/null "http://127.0.0.1:$port/v1/audio/voices" -F name=$voice -F "audio_sample=@$ref_clip" \
        -F "ref_text=A short reference sentence for the voice clone." \
        || { echo "voice upload failed; log: $out/$run.server.log" >&2; exit 1; }
    fi
    phase "$run" start $((SECONDS - t))

    # warm-up at the largest concurrency (not reported: suite_report.py reads only -c<N> / -rate<R> results)
    t=$SECONDS
    top=$(printf '%s\n' $CONCURRENCY | sort -n | tail -1)
    bench "$run-warmup" --concurrency "$top" --num-prompts "$WARMUPS" --warmups 0 --health-interval-ms 0
    phase "$run" warmup $((SECONDS - t))

    for c in $CONCURRENCY; do
      if past_deadline; then phase "$run" "c=$c skipped" 0; continue; fi
      t=$SECONDS
      bench "$run-c$c" --concurrency "$c" --num-prompts $((2 * c > MIN_PROMPTS ? 2 * c : MIN_PROMPTS)) --warmups 0
      phase "$run" "c=$c" $((SECONDS - t))
    done
    for rate in $RATES; do
      if past_deadline; then phase "$run" "rate=$rate skipped" 0; continue; fi
      t=$SECONDS
      n=$(python -c "import math; print(min($RATE_MAX_PROMPTS, max($MIN_PROMPTS, math.ceil($rate * $RATE_SECONDS))))")
      bench "$run-rate$rate" --request-rate "$rate" --num-prompts "$n" --warmups 0
      phase "$run" "rate=$rate" $((SECONDS - t))
    done
    cleanup
  done
 done
done

config=$(python -c 'import json, sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
  presets "$PRESETS" variants "$VARIANTS" dtype "$DTYPE" stage_configs "$STAGE_CONFIGS" concurrency "$CONCURRENCY" \
  rates "$RATES" \
  max_new_tokens "$MAX_NEW_TOKENS" warmups "$WARMUPS" min_prompts "$MIN_PROMPTS" rate_seconds "$RATE_SECONDS" \
  rate_max_prompts "$RATE_MAX_PROMPTS" smoke "${SMOKE:-0}")
python benchmarks/suite_report.py "$out" --config "$config" \
  --title "gpu_suite: $PRESETS $VARIANTS ($DTYPE) on $STAGE_CONFIGS · max_new_tokens $MAX_NEW_TOKENS"
