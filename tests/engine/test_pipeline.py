"""The chained InstructGPT run (tokenizer -> SFT -> reward model -> PPO) at a tiny size."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _torchrun(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_pipeline_chains_sft_rm_and_ppo(tmp_path: Path) -> None:
    run_dir = tmp_path / "pipeline"
    done = _torchrun("tools/run_pipeline.py", "--run-dir", str(run_dir), "--sft-steps", "12",
                     "--rm-steps", "6", "--ppo-steps", "3", "rollout.prompts_per_step=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward model: step" in done.stdout and (run_dir / "curves.png").stat().st_size > 0
    sft = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").open()]
    assert len(sft) == 12 and sft[-1]["loss"] < sft[0]["loss"]
    records = [json.loads(line) for line in (run_dir / "ppo" / "metrics.jsonl").open()]
    # The last record is the held-out evaluation after the last step (tests/engine/
    # test_evaluation.py checks what it holds).
    ppo = records[:-1]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("reward_mean", "rm_score", "rule_score", "kl", "policy_loss", "value_loss",
                "samples_per_s"):
        assert all(key in record for record in ppo), key
    # PPO started from the SFT actor and the trained reward model, not from fresh weights.
    plan_roles = json.loads((run_dir / "ppo" / "plan.json").read_text())["models"]
    assert "shadow_actor" in plan_roles  # separation is the default placement
    config = (run_dir / "ppo" / "config.yaml").read_text()
    assert str(run_dir / "sft" / "checkpoint") in config
    assert str(run_dir / "rm" / "checkpoint") in config


@pytest.mark.multirank
def test_pipeline_refuses_a_bad_data_file_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\nnot json\n')
    done = _torchrun("tools/run_pipeline.py", "--run-dir", str(tmp_path / "run"), "--data",
                     str(bad), timeout=200)
    assert done.returncode != 0
    # One clear line per rank, naming the file and line; no Python traceback from our code
    # (torchrun's own report of the failed workers follows it).
    assert "run_pipeline: " in done.stderr and "bad.jsonl" in done.stderr
    assert re.search(r'(megatron_rlhf|tools)/\S+\.py", line', done.stderr) is None
