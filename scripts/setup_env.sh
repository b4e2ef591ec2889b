#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron_rlhf into it.
#
# torch: an already importable torch (an NGC PyTorch container's CUDA build) is kept by creating
# the venv with --system-site-packages; otherwise torch==2.13.0 is installed, which on these
# CPU-only machines resolves to the CPU build. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "[setup] keeping the system torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  $PIP install --quiet --upgrade pip
  $PIP install --quiet "torch==2.13.0"
fi
stamp="$VENV/.megatron_rlhf-installed"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  $PIP install --quiet -e ".[$EXTRAS]"
  touch "$stamp"
fi
"$VENV/bin/python" -c "import megatron.core, megatron_rlhf; print('[setup] megatron-core', megatron.core.__version__)"
