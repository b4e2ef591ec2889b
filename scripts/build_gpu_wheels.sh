#!/usr/bin/env bash
# Wheels for a GPU machine without network access (see docs/gpu.md): the Python packages
# megatron_rlhf needs that an NGC-like image does not ship, built here for that machine's Python.
#
#   bash scripts/build_gpu_wheels.sh            # -> .whl/ (ignored by git), Python 3.12, x86-64
#   PY_VERSION=3.10 WHEEL_DIR=/tmp/w bash scripts/build_gpu_wheels.sh
#
# On the GPU machine: python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# (scripts/gpu_check.sh does this itself when .whl/ exists). The versions are the ones this
# project pins or resolves on CPU: megatron-core 0.16.1 (its torch, numpy and packaging come
# with the GPU image) and omegaconf (PyYAML comes with the image).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
WHEEL_DIR=${WHEEL_DIR:-.whl}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MEGATRON_CORE=$(sed -n 's/^MEGATRON_CORE_VERSION = "\(.*\)"/\1/p' setup.py)
OMEGACONF=$("$PYTHON" -c "import omegaconf; print(omegaconf.__version__)" 2>/dev/null || echo 2.4.0)
mkdir -p "$WHEEL_DIR"
rm -f "$WHEEL_DIR"/*.whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHEEL_DIR" \
  "megatron-core==$MEGATRON_CORE" "omegaconf==$OMEGACONF"
ls -1 "$WHEEL_DIR"
