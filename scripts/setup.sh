#!/usr/bin/env bash
# Create .venv (once) and install anyspeed with its test tools. Never pulls a CUDA build of torch
# on a machine without an NVIDIA GPU: there it installs the CPU wheel of torch 2.13.0 first
# (set ANYSPEED_TORCH_INDEX to a CPU wheel index if your pip cannot find one by itself).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.8"
  elif [ -n "${ANYSPEED_TORCH_INDEX:-}" ]; then
    "$VPY" -m pip install -q torch==2.13.0 --index-url "$ANYSPEED_TORCH_INDEX"
  else
    "$VPY" -m pip install -q torch==2.13.0
  fi
fi
"$VPY" -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
# anyspeed is installed editable, so Python compiles its modules on import; where
# PYTHONDONTWRITEBYTECODE is set (as on CI's machine) it would do so again in every process.
"$VPY" -m compileall -q -j 0 src >/dev/null
"$VPY" -W ignore -c "import torch, megatron.core, anyspeed; print('anyspeed ready: torch', torch.__version__)"
