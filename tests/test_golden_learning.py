"""Learning does not change silently: four PPO steps of the tiny job on 2 ranks give the stored
per-step metrics (``tests/golden/learning.json``) within a tolerance that other CPU kernels stay
inside (checked with ATen's default and AVX2 kernels) and that a doubled learning rate, a doubled
KL coefficient or unwhitened advantages leave (checked when the file was stored)."""

from __future__ import annotations

import json

import pytest

from tests.golden.learning import GOLDEN, METRICS, differences, measure


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_tiny_job_learns_as_the_golden_run_did() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert all(count > 0 for count in golden["caught"].values()), golden["caught"]
    assert set(golden["steps"][0]) == set(METRICS)
    moved = differences(measure(), golden["steps"])
    assert not moved, ("the learning curve moved; if the change is meant, store the new figures "
                       "with `python -m tests.golden.learning --update`:\n" + "\n".join(moved))


def test_the_comparison_flags_a_metric_outside_the_tolerance() -> None:
    golden = [dict.fromkeys(METRICS, 1.0)]
    assert differences([dict.fromkeys(METRICS, 1.0005)], golden) == []
    moved = differences([{**golden[0], "kl": 1.01}], golden)
    assert moved == ["step 0 kl: 1 -> 1.01 (tolerance 0.001)"]
    assert differences([], golden) == ["0 steps, the golden run has 1"]
