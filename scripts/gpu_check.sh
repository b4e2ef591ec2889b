#!/usr/bin/env bash
# The GPU check, in one call that fits one device command (docs/gpu.md): tools/run_ppo.py for 2
# steps in fp32 and in bf16 at world size 1 (side by side), the bf16 throughput benchmark of a
# ~1B Llama shape, a ~1B flattening PPO run's per-stage peak memory against the engine's
# prediction, the decode figures of benchmarks/rollouts.py, the gpu-marked tests (three pytest
# processes sharing the GPU) and, with 2 or more GPUs, 3 fp32 steps under NCCL across all of them
# with flattening and with separation (their metrics compared in the summary). Each part has its
# own time limit, the slowest parts last; the limits sum to 330 s on one GPU and 530 s with
# several (tests/test_gpu_check.py holds them to 540 s, what a 600 s command leaves for set-up
# and the summary). The last line printed is one JSON summary, also when a part fails or runs
# out of time.
#
#   bash scripts/gpu_check.sh                 # on a GPU machine (or on CPU: GPU parts skip)
#
# $LOG_DIR (default $OUT when set, else runs/gpu_check) gets three files only: summary.json,
# parts.txt (name, exit status, seconds, limit per part) and gpu_check.log (every part's log,
# one after another). Run directories and per-part logs go to a fresh /tmp/gpu_check_runs.XXXXXX,
# never under $LOG_DIR. On a machine without network, build the wheels it needs first
# (bash scripts/build_gpu_wheels.sh) and bring .whl/ along: they are installed into a temporary
# directory when megatron-core is missing. Exit status: 0 when every part that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
LOG_DIR=${LOG_DIR:-${OUT:-runs/gpu_check}}
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR/parts.txt" "$LOG_DIR/summary.json" "$LOG_DIR/gpu_check.log"
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_runs.XXXXXX") || exit 1
PART_LOGS=$RUN_DIR/logs
mkdir -p "$PART_LOGS"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
export PYTHON RUN_DIR PART_LOGS PYTHONUNBUFFERED=1
echo "[gpu_check] run directories and part logs in $RUN_DIR; results in $LOG_DIR"

if ! "$PYTHON" -c "import megatron.core, omegaconf" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/megatron_rlhf_site .whl/*.whl >"$PART_LOGS/wheels.log" 2>&1
    export PYTHONPATH=/tmp/megatron_rlhf_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "megatron-core or omegaconf is missing and there is no .whl/: run" \
         "scripts/build_gpu_wheels.sh where pip works and bring .whl/ along" \
      | tee "$PART_LOGS/wheels.log" >&2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>>"$PART_LOGS/wheels.log") || gpus=0
[[ $gpus =~ ^[0-9]+$ ]] || gpus=0

run_part() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "[gpu_check] $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" >"$PART_LOGS/$name.log" 2>&1
  local status=$?
  echo "$name $status $((SECONDS - start)) $limit" >>"$LOG_DIR/parts.txt"
  echo "[gpu_check] $name: exit $status after $((SECONDS - start)) s"
  tail -n 5 "$PART_LOGS/$name.log"
}

# shellcheck disable=SC2329  # run by run_part through bash -c (export -f below)
ppo_dtypes() {  # run_ppo at world size 1 in fp32 and bf16, side by side; fails if either fails
  local dtype pids=() status=0
  for dtype in float32 bfloat16; do
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 tools/run_ppo.py \
      --steps 2 --run-dir "$RUN_DIR/ppo_$dtype" "models.params_dtype=$dtype" \
      >"$PART_LOGS/run_ppo_$dtype.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  tail -n 3 "$PART_LOGS"/run_ppo_*.log
  return "$status"
}

# shellcheck disable=SC2329
gpu_test_shards() {  # the gpu-marked tests, in $1 pytest processes side by side (one per shard)
  local shards=$1 shard pids=() status=0
  for ((shard = 0; shard < shards; shard++)); do
    PYTHONPATH=$PWD/scripts:$PYTHONPATH "$PYTHON" -m pytest -v -rs -m gpu -p no:cacheprovider \
      -p gpu_check_shard --gpu-shard "$shard/$shards" tests/gpu tests/engine/test_memory.py \
      >"$PART_LOGS/gpu_tests.$shard.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  tail -n 2 "$PART_LOGS"/gpu_tests.*.log
  return "$status"
}
# shellcheck disable=SC2329
nccl_ppo() {  # placement [overrides...]: 3 fp32 steps on every GPU under NCCL
  local name=nccl_$1
  [ $# -gt 1 ] && name=nccl_async_$1
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$gpus" tools/run_ppo.py \
    --steps 3 --placement "$1" --run-dir "$RUN_DIR/$name" models.params_dtype=float32 \
    runtime.allow_tf32=false runtime.transfer_timeout_s=60 runtime.distributed.timeout_s=60 \
    "${@:2}"
}
export gpus
export -f ppo_dtypes gpu_test_shards nccl_ppo

if [ "$gpus" -ge 1 ]; then
  run_part run_ppo 50 bash -c ppo_dtypes
  # Training MFU and decode tokens/s of a ~1.1B shape, for each attention backend
  run_part throughput 50 "$PYTHON" benchmarks/gpu_throughput.py --train-steps 2
  # Per-stage peak memory of a ~1B flattening PPO run against the engine's prediction
  run_part stage_memory 65 "$PYTHON" benchmarks/stage_memory.py
  # Decoding: the 1.1B decode step at batch 64 and 256 with CUDA graphs on and off, static
  # against continuous batching with uneven answers, the loops' agreement in fp32, a profile of
  # 10 decode steps, a 7B decode step (benchmarks/rollouts.py; its CPU dry run is a test)
  run_part rollouts 80 "$PYTHON" benchmarks/rollouts.py --gpu-check
  run_part gpu_tests 85 bash -c "gpu_test_shards 3"
else
  run_part gpu_tests 85 bash -c "gpu_test_shards 1"
fi
if [ "$gpus" -ge 2 ]; then
  # The engine under NCCL across devices, every placement that one kind of GPU allows: transfer
  # channels, interleaved models, shadows and weight sync, asynchronous rollouts; fp32 without
  # TF32, so the synchronous placements' steps can be compared with flattening's.
  run_part nccl_flattening 40 bash -c "nccl_ppo flattening"
  run_part nccl_interleaving 40 bash -c "nccl_ppo interleaving"
  run_part nccl_interleaving2 40 bash -c "nccl_ppo interleaving2"
  run_part nccl_separation 40 bash -c "nccl_ppo separation"
  run_part nccl_async_separation 40 bash -c "nccl_ppo separation rollout.async_rollout=true"
fi

"$PYTHON" scripts/gpu_check_summary.py "$LOG_DIR" "$RUN_DIR" 2>"$PART_LOGS/summary.log"
status=$?
if [ ! -s "$LOG_DIR/summary.json" ]; then  # the summary itself failed: say so in one JSON line
  parts=$(tr '\n' ';' <"$LOG_DIR/parts.txt" 2>/dev/null)
  echo "{\"gpu_check\": \"the summary failed, see summary.log in gpu_check.log\"," \
       "\"parts_txt\": \"${parts//\"/}\", \"passed\": false}"
  status=1
fi
for log in "$PART_LOGS"/*.log "$RUN_DIR"/*/metrics.jsonl; do  # one file back, 1 MiB per log
  [ -f "$log" ] || continue
  printf '\n##### gpu_check: %s #####\n' "${log#"$RUN_DIR"/}"
  tail -c 1048576 "$log"
done >"$LOG_DIR/gpu_check.log" 2>/dev/null
[ "$gpus" -eq 0 ] && rm -rf "$RUN_DIR"  # without CUDA only logs, now all in gpu_check.log
exit $status
