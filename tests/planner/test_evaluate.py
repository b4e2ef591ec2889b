"""Predicted against measured: stage ratios and ranking agreement."""

from __future__ import annotations

import pytest

from megatron_rlhf.planner import (
    RolloutSpec,
    compare_rankings,
    compare_stage_times,
    homogeneous_cluster,
    predict_step,
    within_factor,
)
from megatron_rlhf.topology import PlacementConfig, plan_placement


def test_stage_ratios_are_predicted_over_measured() -> None:
    plan = plan_placement(homogeneous_cluster("A100-80GB", 1, 8),
                          PlacementConfig("flattening", tp=2), "llama-7b")
    prediction = predict_step(plan, RolloutSpec(batch=64))
    measured = {"generation": prediction.stage_seconds["generation"] * 2,
                "step": prediction.step_seconds / 3, "sync": 0.0}
    ratios = compare_stage_times(prediction, measured)
    assert ratios == pytest.approx({"generation": 0.5, "step": 3.0})
    assert within_factor(ratios, 3.0) and not within_factor(ratios, 2.0)
    with pytest.raises(ValueError, match="unknown keys"):
        compare_stage_times(prediction, {"rollout": 1.0})


def test_ranking_agreement_counts_concordant_pairs() -> None:
    report = compare_rankings({"a": 3.0, "b": 2.0, "c": 1.0}, {"a": 1.5, "b": 0.5, "c": 1.0})
    assert report.predicted_order == ("a", "b", "c")
    assert report.measured_order == ("a", "c", "b")
    assert report.kendall_tau == pytest.approx(1 / 3)  # 2 concordant, 1 discordant of 3 pairs
    assert not report.same_order and report.ratios["a"] == 2.0
    with pytest.raises(ValueError, match="same two or more"):
        compare_rankings({"a": 1.0}, {"b": 1.0})
