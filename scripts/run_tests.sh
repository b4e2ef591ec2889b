#!/usr/bin/env bash
# The test suite on CPU (gloo ranks as processes). Extra arguments go to pytest, e.g.
#   bash scripts/run_tests.sh -m "not multirank"     # the quick single-process subset
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
