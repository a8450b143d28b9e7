#!/usr/bin/env bash
# CPU regression suite: serve the `small` random model (omni_tts/stage_configs/cpu_small.yaml), sweep concurrency 1/4/16
# with bench_tts_serve.py, stop the server. Results land in benchmarks/results/cpu-small-<time>.{json,md,png}.
#   bash benchmarks/cpu_suite.sh [extra bench_tts_serve.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${OMNI_TTS_CACHE:-$HOME/.cache/omni_tts}/small-custom-voice-seed0
[ -f "$model/speech_tokenizer/model.safetensors" ] || \
  omni-tts make-tiny-model "$model" --variant custom_voice --preset small --seed 0 --dtype float32
port=${PORT:-8088}
omni-tts serve --model "$model" --stage-config cpu_small --served-model-name qwen3-tts-small --port "$port" \
  --max-queue 512 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited" >&2; exit 1; }
  sleep 1
done
python benchmarks/bench_tts_serve.py --base-url "http://127.0.0.1:$port" --model qwen3-tts-small --voice ryan \
  --concurrency 1 4 16 --num-prompts 16 --warmups 2 --max-new-tokens 100 --seed 0 \
  --name "cpu-small-$(date -u +%Y%m%dT%H%M%S)" "$@"
