#!/usr/bin/env bash
# The main job: a tiny PPO run on CPU with 4 gloo ranks (same code path as a GPU cluster).
# Extra arguments go to tools/run_ppo.py, e.g.  bash scripts/run_ppo.sh --placement separation
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
NPROC=${NPROC:-4}
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" tools/run_ppo.py "$@"
