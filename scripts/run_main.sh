#!/usr/bin/env bash
# The main job: the whole InstructGPT pipeline (tokenizer -> SFT -> reward model -> PPO) on the
# shipped synthetic task, on CPU with 4 gloo ranks (the same code path as a GPU cluster), ending
# with a short report and runs/pipeline/curves.png. Extra arguments go to tools/run_pipeline.py:
#   bash scripts/run_main.sh --placement interleaving
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
NPROC=${NPROC:-4}
RUN_DIR=${RUN_DIR:-runs/pipeline-$(date +%Y%m%d-%H%M%S)}
# torch's launcher as a module: a venv that borrows the system torch (an NGC container) has no
# .venv/bin/torchrun of its own.
exec .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  tools/run_pipeline.py --run-dir "$RUN_DIR" "$@"
