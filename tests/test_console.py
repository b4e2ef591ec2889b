"""The main job's console holds the run's own lines: no warnings from third-party code (megatron's
deprecated torch calls, its notices about missing GPU extras) reach it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def test_a_ppo_run_that_saves_prints_no_warnings(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS}
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_ppo.py"), "--steps", "1", "--placement",
         "flattening", "--run-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "ck"),
         "rollout.prompts_per_step=8", "rollout.num_minibatches=1"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    console = (result.stdout + result.stderr).splitlines()
    warnings = [line for line in console if "Warning" in line or "warnings.warn" in line]
    assert not warnings, "\n".join(warnings)
    assert any("run_ppo: done" in line for line in console)
