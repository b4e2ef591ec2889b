#!/usr/bin/env bash
# The GPU check, in one call (docs/gpu.md): the gpu-marked tests, tools/run_ppo.py for 3 steps in
# fp32 and in bf16 at world size 1, the bf16 throughput benchmark of a ~1B Llama shape (its training
# step over packed sequences, the default of every run, and over padded rows), a ~1B flattening
# PPO run's per-stage peak memory against the engine's prediction, the decode figures of
# benchmarks/rollouts.py (CUDA graphs on and off, a 7B shape, a profile) and, with 2
# or more GPUs, 3 fp32 steps under NCCL across all of them with flattening and with separation
# (their metrics compared in the summary). Each part has its own time limit (about 6 minutes in
# all on one H200, 14 with several GPUs); logs go to $LOG_DIR (default $OUT when set, else
# runs/gpu_check) and the last line printed is one JSON summary.
#
#   bash scripts/gpu_check.sh                 # on a GPU machine (or on CPU: GPU parts skip)
#
# On a machine without network, build the wheels it needs first (bash scripts/build_gpu_wheels.sh)
# and bring .whl/ along: they are installed into a temporary directory when megatron-core is
# missing. Exit status: 0 when every part that ran passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
LOG_DIR=${LOG_DIR:-${OUT:-runs/gpu_check}}
mkdir -p "$LOG_DIR"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
export PYTHONUNBUFFERED=1

if ! "$PYTHON" -c "import megatron.core, omegaconf" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "megatron-core or omegaconf is missing and there is no .whl/: run" \
         "scripts/build_gpu_wheels.sh where pip works and bring .whl/ along" >&2
    exit 1
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/megatron_rlhf_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/megatron_rlhf_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run_part() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "[gpu_check] $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  local status=$?
  echo "$name $status $((SECONDS - start))" >>"$LOG_DIR/parts.txt"
  echo "[gpu_check] $name: exit $status after $((SECONDS - start)) s ($LOG_DIR/$name.log)"
  tail -n 5 "$LOG_DIR/$name.log"
}

rm -f "$LOG_DIR/parts.txt"
run_part gpu_tests 240 "$PYTHON" -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu \
  tests/engine/test_memory.py
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  for dtype in float32 bfloat16; do
    run_part "run_ppo_$dtype" 150 "$PYTHON" -m torch.distributed.run --standalone \
      --nproc-per-node 1 tools/run_ppo.py --steps 3 --run-dir "$LOG_DIR/ppo_$dtype" \
      "models.params_dtype=$dtype"
  done
  run_part throughput 240 "$PYTHON" benchmarks/gpu_throughput.py
  # Per-stage peak memory of a ~1B flattening PPO run against the engine's prediction
  run_part stage_memory 150 "$PYTHON" benchmarks/stage_memory.py
  # Decoding: 1.1B shape at batch 64 and 256 with CUDA graphs on and off, static against
  # continuous batching with uneven answers (the slots shrink), a 7B shape's decode
  # step, a profile of 10 decode steps (benchmarks/rollouts.py; its CPU dry run is a test)
  run_part rollouts 240 "$PYTHON" benchmarks/rollouts.py --gpu-check
  gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
  if [ "$gpus" -ge 2 ]; then
    # The engine under NCCL across devices: transfer channels, shadows and weight sync
    # (separation), the same steps on one layout (flattening) to compare with, fp32 without TF32.
    for placement in flattening separation; do
      run_part "nccl_$placement" 240 "$PYTHON" -m torch.distributed.run --standalone \
        --nproc-per-node "$gpus" tools/run_ppo.py --steps 3 --placement "$placement" \
        --run-dir "$LOG_DIR/nccl_$placement" models.params_dtype=float32 runtime.allow_tf32=false \
        runtime.transfer_timeout_s=120 runtime.distributed.timeout_s=120
    done
  fi
fi
exec "$PYTHON" scripts/gpu_check_summary.py "$LOG_DIR"
