"""One step of each tiny PPO example that no other test runs end to end, as its header says to.

``ppo_tiny``, ``ppo_grpo_tiny`` and ``ppo_hf_tiny`` run in the quickstart, engine and reliability
tests; these run here: a user copying their command gets a finished step and a metrics record.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import REPO, run_tool

RUNS = {"ppo_gsm8k_tiny.yaml": 2, "grpo_arithmetic.yaml": 1}
"""Example -> ranks (fewer than its header's where that is enough to run it)."""


@pytest.mark.multirank
@pytest.mark.timeout(330)
@pytest.mark.parametrize("example", sorted(RUNS))
def test_the_example_runs_a_step(example: str, tmp_path) -> None:
    result = run_tool("run_ppo.py", ["--config", str(REPO / "examples" / example), "--steps", "1",
                                     f"run_dir={tmp_path}"], nproc=RUNS[example], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 1 and steps[0]["response_length"] > 0, records
