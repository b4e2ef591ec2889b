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


def _run_ppo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS}
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_ppo.py"), *args, "--placement", "flattening",
         "--run-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "ck"),
         "--algorithm", "grpo", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
         "rollout.num_minibatches=1"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=80)  # three runs of a few seconds each within the test's 300 s


def test_a_resumed_grpo_runs_console_names_its_steps_and_outputs(tmp_path: Path) -> None:
    """Redirected output: one line per step labelled with the algorithm, no carriage returns;
    the resumed run counts from its checkpoint to the last step; the last line says where the
    checkpoints went; --steps below the checkpoint's step is refused naming both."""
    first = _run_ppo(tmp_path, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _run_ppo(tmp_path, "--steps", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    console = resumed.stdout + resumed.stderr
    assert "\r" not in console
    steps = [line for line in console.splitlines() if line.startswith("grpo: step ")]
    assert [line.split()[2] for line in steps] == ["3/4", "4/4"], console[-3000:]
    last = console.splitlines()[-1]
    assert last == (f"run_ppo: done; metrics in {tmp_path / 'run' / 'metrics.jsonl'}; "
                    f"checkpoints in {tmp_path / 'ck'} (newest step_00000004)"), last
    behind = _run_ppo(tmp_path, "--steps", "3", "--resume")
    assert behind.returncode == 2
    assert (f"run_ppo: steps=3 (--steps) is below the step of the checkpoint to resume from, "
            f"{tmp_path / 'ck' / 'step_00000004'} (4 steps done), so the run would train "
            "nothing; give --steps above 4 to train on") in behind.stderr, behind.stderr[-3000:]


def test_a_failing_reward_function_is_one_message_without_a_traceback(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS}
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_ppo.py"), "--steps", "1", "--placement",
         "flattening", "--run-dir", str(tmp_path / "run"), "rollout.prompts_per_step=8",
         "rollout.num_minibatches=1",
         "reward.functions=[{name: 'tests.rewards.user_functions:explodes'}]"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    failures = [line for line in result.stderr.splitlines() if line.startswith("run_ppo: ")]
    assert len(failures) == 1, result.stderr[-3000:]
    assert failures[0].startswith("run_ppo: rank 0: reward function "
                                  "'tests.rewards.user_functions:explodes' raised "
                                  "ZeroDivisionError: the grader divided by zero on prompt "
                                  "record #"), failures
