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
from megatron_rlhf.planner.schedule import covered_seconds
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


def test_placements_whose_runs_overlap_are_ties() -> None:
    predicted = {"a": 3.0, "b": 2.0, "c": 1.0}
    measured = {"a": 1.0, "b": 1.1, "c": 0.5}  # a and b swapped, but their runs overlap
    spread = {"a": (0.9, 1.2), "b": (1.0, 1.3), "c": (0.4, 0.6)}
    report = compare_rankings(predicted, measured, spread)
    assert report.ties == (("a", "b"),)
    assert report.separable_agree and not report.same_order
    assert report.kendall_tau == pytest.approx(1 / 3)
    # Runs that do not overlap make the swap a real disagreement.
    narrow = {"a": (0.95, 1.05), "b": (1.08, 1.12), "c": (0.4, 0.6)}
    report = compare_rankings(predicted, measured, narrow)
    assert report.ties == () and not report.separable_agree
    # Without ranges nothing is a tie: agreement means the same order.
    assert not compare_rankings(predicted, measured).separable_agree
    # A predicted tie does not order a pair the measurement separates.
    assert not compare_rankings({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 2.0}).separable_agree


def test_measured_ranges_must_cover_every_name_and_its_median() -> None:
    with pytest.raises(ValueError, match="measured_range names"):
        compare_rankings({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}, {"a": (0.5, 1.5)})
    with pytest.raises(ValueError, match="outside their measured_range"):
        compare_rankings({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0},
                         {"a": (1.1, 1.5), "b": (1.5, 2.5)})


def test_covered_seconds_is_the_union_of_intervals() -> None:
    assert covered_seconds([]) == 0.0
    assert covered_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5), (3.1, 3.2)]) == pytest.approx(2.5)
