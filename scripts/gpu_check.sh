#!/usr/bin/env bash
# The GPU check: one command that tells whether this project works on a GPU node, and how fast.
# Run it on one node of the cluster (an interactive allocation or a batch job of one node; any
# number of its GPUs). It writes its results into --out DIR (default runs/gpu_check) and
# finishes within a time budget of 9 minutes, so a job of 10 minutes holds it: each part runs
# under its own time limit, and the last line printed is one JSON summary (also in
# DIR/summary.json), also when a part fails or runs out of time.
#
#   bash scripts/gpu_check.sh                         # results in runs/gpu_check
#   bash scripts/gpu_check.sh --out /scratch/gpu_check
#   PYTHON=python3 bash scripts/gpu_check.sh          # the node's own Python (and .whl/)
#
# The environment's LOG_DIR (or OUT) names the output directory too, when --out is not given.
#
# The parts, fastest first (docs/gpu.md has the table):
#   run_ppo, moe_ep1, multi_turn, te  side by side at world size 1: tools/run_ppo.py for 2 steps
#       in fp32 and in bf16; an MoE policy at ep 1 with CUDA graphs left at auto (MoE decodes
#       eagerly); 2 steps of 2-turn episodes with an environment (scripts/gpu_check_env.py);
#       with Transformer Engine installed, one step whose critic and reference take TE layers
#       (without it the part says "skipped: transformer_engine not installed" and passes).
#       Each run must write every step's record with throughput/tokens_per_s_per_device (the
#       step's all-reduce over the world: on NCCL it needs CUDA tensors).
#   replan  3 steps re-planning after every step, with forced moves (scripts/gpu_check_move.py):
#       to the same placement on one GPU, to separation and back to flattening under NCCL
#       across every GPU with 2 or more.
#   throughput, stage_memory, rollouts  the bf16 benchmarks of a ~1B Llama shape: training and
#       decode speed, each stage's memory peak against the engine's prediction, decoding with
#       CUDA graphs on and off, static against continuous batching.
#   gpu_tests  the gpu-marked tests, three pytest processes sharing the GPU.
#   nccl_*  with 2 or more GPUs: 3 fp32 steps under NCCL across all of them per placement,
#       their metrics compared in the summary.
# The limits add up to 365 s on one GPU and 540 s with several (the side-by-side parts count
# once, with their largest limit), which leaves set-up and the summary a minute of the budget;
# tests/test_gpu_check.py holds them there.
#
# The output directory gets three files only: summary.json, parts.txt (name, exit status,
# seconds, limit and side-by-side group per part) and gpu_check.log (every part's log, every run's
# metrics and plan history). Run directories and per-part logs go to a fresh
# /tmp/gpu_check_runs.XXXXXX, never under it. Without CUDA the GPU parts skip and only the GPU
# tests' collection runs. On a node without network, build the wheels it needs where pip works
# (bash scripts/build_gpu_wheels.sh writes them into .whl/) and copy .whl/ into this checkout on
# the node: they are installed into a temporary directory when megatron-core is missing. Exit
# status: 0 when every part that ran passed; 2 for an unknown argument.
set -uo pipefail
OUT_ARG=
while [ $# -gt 0 ]; do
  case $1 in
    --out|--out=*)
      if [ "$1" = --out ]; then OUT_ARG=${2:-}; shift; else OUT_ARG=${1#--out=}; fi
      shift
      [ -n "${OUT_ARG// /}" ] || { echo "gpu_check.sh: --out needs a directory" >&2; exit 2; } ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (usage: bash scripts/gpu_check.sh [--out DIR])" >&2
       exit 2 ;;
  esac
done
case $OUT_ARG in  # relative to where the command was given, not to the checkout
  "") ;;
  /*) LOG_DIR=$OUT_ARG ;;
  *) LOG_DIR=$PWD/$OUT_ARG ;;
esac
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

# Found, not imported (an import of megatron-core takes seconds; the parts import it anyway).
if ! "$PYTHON" -c "import importlib.util as u, sys
def found(name):
    try:
        return u.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
sys.exit(0 if found('megatron.core') and found('omegaconf') else 1)" 2>/dev/null; then
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
  timeout --kill-after=3 "$limit" "$@" >"$PART_LOGS/$name.log" 2>&1
  local status=$?
  echo "$name $status $((SECONDS - start)) $limit ${PART_GROUP:-}" >>"$LOG_DIR/parts.txt"
  echo "[gpu_check] $name: exit $status after $((SECONDS - start)) s"
  tail -n 5 "$PART_LOGS/$name.log"
}

side_by_side=() group=1
start_part() {  # run_part in the background, tagged with its group in parts.txt
  PART_GROUP=side_by_side:$group run_part "$@" &
  side_by_side+=($!)
}
wait_parts() {  # for every part start_part started; the next ones form a new group
  local pid
  for pid in "${side_by_side[@]}"; do wait "$pid"; done
  side_by_side=()
  group=$((group + 1))
}

# shellcheck disable=SC2329  # run by run_part through bash -c (export -f below)
ppo_run() {  # name, steps, run_ppo arguments...: world size 1, then its metrics checked
  local name=$1 steps=$2; shift 2
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 tools/run_ppo.py \
    --steps "$steps" --run-dir "$RUN_DIR/$name" "$@" \
    && "$PYTHON" scripts/gpu_check_metrics.py "$RUN_DIR/$name" "$steps"
}

# shellcheck disable=SC2329
ppo_dtypes() {  # run_ppo at world size 1 in fp32 and bf16, side by side; fails if either fails
  local dtype pids=() status=0
  for dtype in float32 bfloat16; do
    ppo_run "ppo_$dtype" 2 "models.params_dtype=$dtype" >"$PART_LOGS/run_ppo_$dtype.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  tail -n 3 "$PART_LOGS"/run_ppo_*.log
  return "$status"
}

# shellcheck disable=SC2329
moe_ep1() {  # an MoE policy at ep 1, generation.cuda_graphs left at auto
  ppo_run moe_ep1 2 --config examples/ppo_moe_tiny.yaml placement.parallel.actor.ep=1 \
    placement.parallel.critic.ep=1 placement.parallel.ref.ep=1
}

# shellcheck disable=SC2329
multi_turn() {  # episodes of 2 replies, an environment answering the first
  PYTHONPATH=$PWD/scripts:$PYTHONPATH ppo_run multi_turn 2 \
    "rollout.environment={name: gpu_check_env:Retry, kwargs: {turns: 2}}" \
    rollout.max_turns=2 rollout.max_episode_tokens=40
}

# shellcheck disable=SC2329
te_layers() {  # with Transformer Engine: 1 step, critic and reference on TE layers (auto)
  if ! "$PYTHON" -c "import transformer_engine" 2>/dev/null; then
    echo "skipped: transformer_engine not installed"
    return 0
  fi
  ppo_run te 1 models.transformer_impl=auto >"$RUN_DIR/te.out" 2>&1
  local status=$?
  cat "$RUN_DIR/te.out"
  [ "$status" -eq 0 ] || return "$status"
  grep -q "layers: .*transformer_engine" "$RUN_DIR/te.out" \
    || { echo "te: no model took Transformer Engine layers (see the layers: line)"; return 1; }
}

# shellcheck disable=SC2329
replan_move() {  # 3 steps re-planning after each; forced moves; every GPU (NCCL with 2 or more)
  local moves=(--move "0=flattening") expected=1 moved
  if [ "$gpus" -ge 2 ]; then moves=(--move "0=separation" --move "1=flattening"); expected=2; fi
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
    scripts/gpu_check_move.py "${moves[@]}" --steps 3 --run-dir "$RUN_DIR/replan" \
    placement.replan.interval_steps=1 placement.replan.warmup_steps=0 \
    placement.replan.move=true placement.replan.profile=H100-80GB \
    runtime.transfer_timeout_s=60 runtime.distributed.timeout_s=60 || return 1
  "$PYTHON" scripts/gpu_check_metrics.py "$RUN_DIR/replan" 3 \
    throughput/tokens_per_s_per_device replan/predicted_gain || return 1
  moved=$(grep -c '"moved"' "$RUN_DIR/replan/plan_history.jsonl")
  [ "$moved" -eq "$expected" ] \
    || { echo "replan: $moved moves in plan_history.jsonl, $expected forced"; return 1; }
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
export -f ppo_run ppo_dtypes moe_ep1 multi_turn te_layers replan_move gpu_test_shards nccl_ppo

if [ "$gpus" -ge 1 ]; then
  # Short runs at world size 1, side by side on the first GPU (the part's limit is its own;
  # the group takes as long as its slowest)
  start_part run_ppo 50 bash -c ppo_dtypes
  start_part moe_ep1 45 bash -c moe_ep1
  start_part multi_turn 55 bash -c multi_turn
  start_part te 45 bash -c te_layers
  wait_parts
  run_part replan 45 bash -c replan_move
  # Training MFU and decode tokens/s of a ~1.1B shape, for each attention backend
  run_part throughput 50 "$PYTHON" benchmarks/gpu_throughput.py --train-steps 2
  # Per-stage peak memory of a ~1B flattening PPO run against the engine's prediction
  run_part stage_memory 60 "$PYTHON" benchmarks/stage_memory.py
  # Decoding: the 1.1B decode step at batch 64 and 256 with CUDA graphs on and off, static
  # against continuous batching with uneven answers, the loops' agreement in fp32, a profile of
  # 10 decode steps, a 7B decode step (benchmarks/rollouts.py; its CPU dry run is a test)
  run_part rollouts 75 "$PYTHON" benchmarks/rollouts.py --gpu-check
  run_part gpu_tests 80 bash -c "gpu_test_shards 3"
else
  run_part gpu_tests 80 bash -c "gpu_test_shards 1"
fi
if [ "$gpus" -ge 2 ]; then
  # The engine under NCCL across devices, every placement that one kind of GPU allows: transfer
  # channels, interleaved models, shadows and weight sync, asynchronous rollouts; fp32 without
  # TF32, so the synchronous placements' steps can be compared with flattening's.
  run_part nccl_flattening 35 bash -c "nccl_ppo flattening"
  run_part nccl_interleaving 35 bash -c "nccl_ppo interleaving"
  run_part nccl_interleaving2 35 bash -c "nccl_ppo interleaving2"
  run_part nccl_separation 35 bash -c "nccl_ppo separation"
  run_part nccl_async_separation 35 bash -c "nccl_ppo separation rollout.async_rollout=true"
fi

"$PYTHON" scripts/gpu_check_summary.py "$LOG_DIR" "$RUN_DIR" 2>"$PART_LOGS/summary.log"
status=$?
if [ ! -s "$LOG_DIR/summary.json" ]; then  # the summary itself failed: say so in one JSON line
  parts=$(tr '\n' ';' <"$LOG_DIR/parts.txt" 2>/dev/null)
  echo "{\"gpu_check\": \"the summary failed, see summary.log in gpu_check.log\"," \
       "\"parts_txt\": \"${parts//\"/}\", \"passed\": false}"
  status=1
fi
for log in "$PART_LOGS"/*.log "$RUN_DIR"/*/metrics.jsonl "$RUN_DIR"/*/plan_history.jsonl; do
  [ -f "$log" ] || continue
  printf '\n##### gpu_check: %s #####\n' "${log#"$RUN_DIR"/}"
  tail -c 1048576 "$log"  # one file back, 1 MiB per log
done >"$LOG_DIR/gpu_check.log" 2>/dev/null
[ "$gpus" -eq 0 ] && rm -rf "$RUN_DIR"  # without CUDA only logs, now all in gpu_check.log
exit $status
