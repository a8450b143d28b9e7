#!/usr/bin/env bash
# Creates a side virtualenv with the official Qwen3-ForcedAligner inference code (PyPI qwen-asr 0.0.6) for golden
# fixtures. It is never a dependency of omni_tts.
#
#   bash setup_reference_env.sh [VENV_DIR]        (default: ~/.cache/qwen3-forced-aligner-reference/venv)
#
# qwen-asr is installed without its dependencies on purpose: gradio, flask and qwen-omni-utils serve its demos and
# server, vllm its other backend; the aligner needs transformers (its pinned 4.57.6), accelerate, librosa and
# soundfile, nagisa (its Japanese word splitter) and soynlp (its Korean one).
set -euo pipefail
VENV=${1:-$HOME/.cache/qwen3-forced-aligner-reference/venv}
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0
"$PIP" install -q --no-deps qwen-asr==0.0.6
"$PIP" install -q transformers==4.57.6 accelerate==1.12.0 nagisa==0.2.11 soynlp==0.0.493 librosa soundfile numpy \
  safetensors
"$VENV/bin/python" - <<'PY'
import torch, transformers
from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForcedAligner  # noqa: F401  (the import is the check)
print("reference env ready: torch", torch.__version__, "transformers", transformers.__version__)
PY
