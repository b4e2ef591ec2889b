"""Re-ranking placements from measured stage times: the calibration reproduces the measured
times, and a generation much slower than predicted turns the ranking towards separation."""

from __future__ import annotations

import pytest

from megatron_rlhf.planner import RolloutSpec, predict_step
from megatron_rlhf.planner.hardware import homogeneous_cluster
from megatron_rlhf.planner.replan import Measured, calibrate, measured_rollout, rerank
from megatron_rlhf.planner.search import describe
from megatron_rlhf.topology import PlacementConfig, plan_placement
from megatron_rlhf.topology.placement_config import ReplanConfig

OPTIONS = ("offload",)
CLUSTER = homogeneous_cluster("A100-80GB", 1, 4)
# Training dominates (4 epochs, short answers): flattening trains on all four devices and wins.
ROLLOUT = RolloutSpec(batch=64, prompt_length=64, generation_length=32, ppo_epochs=4)
FLAT = plan_placement(CLUSTER, PlacementConfig("flattening"), "small")
SEP = plan_placement(CLUSTER, PlacementConfig("separation"), "small")
CANDIDATES = [(describe(FLAT), FLAT), (describe(SEP), SEP)]


def _measured(generation_factor: float) -> Measured:
    """The flattening run's predicted times, its generation ``generation_factor`` times slower."""
    predicted = predict_step(FLAT, ROLLOUT, None, OPTIONS)
    stages = {stage: seconds * (generation_factor if stage == "generation" else 1.0)
              for stage, seconds in predicted.stage_seconds.items()}
    return Measured(stages, predicted.step_seconds, ROLLOUT.generation_length)


def test_measured_times_as_predicted_keep_flattening_first() -> None:
    result = rerank(CANDIDATES[0], CANDIDATES, ROLLOUT, _measured(1.0), None, OPTIONS)
    assert [c.label for c in result.ranking] == [describe(FLAT), describe(SEP)]
    assert result.best.label == describe(FLAT) and result.gain == 0.0
    assert all(scale == pytest.approx(1.0) for scale in result.scales.values())


def test_a_slow_generation_flips_the_ranking_to_separation() -> None:
    factor = 10.0
    result = rerank(CANDIDATES[0], CANDIDATES, ROLLOUT, _measured(factor), None, OPTIONS)
    assert result.best.label == describe(SEP)
    assert result.scales["generation"] == pytest.approx(factor)
    # By hand: flattening runs its stages one after another, so its calibrated step is the
    # sum of its stages with generation 10x; separation's pipelined step is at least its own
    # generation 10x (the shadows' side), and both sides run at once.
    flat = predict_step(FLAT, ROLLOUT, None, OPTIONS).stage_seconds
    by_hand = sum(seconds * (factor if stage == "generation" else 1.0)
                  for stage, seconds in flat.items())
    assert result.current.prediction.step_seconds == pytest.approx(by_hand, rel=1e-9)
    separation = predict_step(SEP, ROLLOUT, None, OPTIONS)
    assert result.best.prediction.step_seconds >= factor * separation.stage_seconds["generation"]
    assert result.best.prediction.step_seconds < by_hand
    assert result.gain == pytest.approx(1 - result.best.prediction.step_seconds / by_hand)
    # Again through predict_step directly, with the factors the calibration found.
    direct = predict_step(SEP, ROLLOUT, None, OPTIONS, stage_scale=result.scales)
    assert direct.step_seconds == result.best.prediction.step_seconds


def test_each_candidate_is_priced_with_its_own_shapes() -> None:
    """``shapes_of`` (a run's token budgets) gives separation micro-batches of 1 row and
    flattening of 8; each plan is calibrated and priced with its own, and the measured answer
    length reaches both."""
    from dataclasses import replace

    seen = []

    def shapes_of(plan, shapes):
        seen.append((plan, shapes.answer_lengths))
        return replace(shapes, micro_batch_size=1 if plan is SEP else 8)

    measured = Measured(_measured(1.0).stage_seconds, _measured(1.0).step_seconds, 12.0)
    result = rerank(CANDIDATES[0], CANDIDATES, ROLLOUT, measured, None, OPTIONS, shapes_of)
    lengths = measured_rollout(ROLLOUT, 12.0).answer_lengths
    assert {answers for _, answers in seen} == {lengths}
    assert lengths.mean == pytest.approx(12, rel=1e-2) and lengths.cap == 32
    assert result.rollout.micro_batch_size == 8 and result.rollout.answer_lengths == lengths
    flat_shapes = replace(ROLLOUT, answer_lengths=lengths, micro_batch_size=8)
    scales, _, after = calibrate(FLAT, flat_shapes, measured, None, OPTIONS)
    assert result.current.prediction.step_seconds == after.step_seconds
    priced = {c.label: c.prediction.step_seconds for c in result.ranking}
    separation = predict_step(SEP, replace(flat_shapes, micro_batch_size=1), None, OPTIONS,
                              stage_scale=scales)
    assert priced[describe(SEP)] == separation.step_seconds
    same = rerank(CANDIDATES[0], CANDIDATES, ROLLOUT, measured, None, OPTIONS)
    assert {c.label: c.prediction.step_seconds for c in same.ranking}[describe(SEP)] != (
        separation.step_seconds), "the shapes changed the price"


def test_calibration_reproduces_the_measured_stage_times() -> None:
    measured = Measured({"generation": 0.5, "training": 0.02, "experience": 0.04},
                        step_seconds=0.6, response_length=20.0)
    shapes = measured_rollout(ROLLOUT, measured.response_length)
    assert shapes.generation_length == 32 and shapes.priced_sequence_length == 64 + 20
    scales, before, after = calibrate(FLAT, shapes, measured, None, OPTIONS)
    for stage, seconds in measured.stage_seconds.items():
        assert after.stage_seconds[stage] == pytest.approx(seconds, rel=1e-6)
        assert scales[stage] == pytest.approx(seconds / before.stage_seconds[stage], rel=1e-6)
    result = rerank(CANDIDATES[0], CANDIDATES, ROLLOUT, measured, None, OPTIONS)
    versus = result.predicted_vs_measured
    assert versus["generation"]["measured"] == 0.5
    assert versus["generation"]["predicted_before"] == pytest.approx(
        before.stage_seconds["generation"], abs=1e-6)
    assert versus["generation"]["predicted_after"] == pytest.approx(0.5, abs=1e-6)
    assert versus["step"]["measured"] == 0.6


def test_an_unknown_measured_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="'decode'"):
        Measured({"decode": 1.0}, 1.0, 10.0)


@pytest.mark.parametrize(("fields", "match"), [
    ({"interval_steps": -1}, "placement.replan.interval_steps=-1"),
    ({"warmup_steps": 1.5}, "placement.replan.warmup_steps=1.5"),
    ({"min_gain": 1.0}, "placement.replan.min_gain=1.0"),
    ({"min_gain": -0.1}, "placement.replan.min_gain=-0.1"),
    ({"horizon_steps": -2}, "placement.replan.horizon_steps=-2"),
])
def test_bad_replan_settings_are_refused_naming_the_field(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        ReplanConfig(**fields)


def test_replan_settings_read_from_yaml_become_a_replan_config() -> None:
    placement = PlacementConfig("flattening", replan={"interval_steps": 2, "min_gain": 0.1})
    assert placement.replan == ReplanConfig(interval_steps=2, min_gain=0.1)
    assert placement.replan.enabled and not PlacementConfig().replan.enabled
    with pytest.raises(ValueError, match=r"placement\.replan has unknown keys \['interval'\]"):
        PlacementConfig(replan={"interval": 2})


def test_measured_answers_are_priced_as_a_distribution_cut_at_the_longest() -> None:
    """Forced full-length answers stay at the cap; shorter ones become exponential answers of
    the measured mean, cut at the longest measured (the cap stays the KV cache's length)."""
    assert measured_rollout(ROLLOUT, 32.0).answer_lengths is None
    spread = measured_rollout(ROLLOUT, 10.0, longest=20.0)
    lengths = spread.answer_lengths
    assert spread.generation_length == lengths.cap == 32 and lengths.lengths[-1] == 20
    assert lengths.mean == pytest.approx(10, rel=1e-2)
    assert measured_rollout(ROLLOUT, 10.0).answer_lengths.lengths[-1] == 32


def test_a_first_move_is_estimated_part_by_part_as_measured() -> None:
    """Three moves of the 4-rank ppo_tiny run (start-up builds 0.38-0.49 s, 0.441 s on average;
    3 MB of state) took save 0.326, teardown 0.044, build 0.251, load 0.173 s on average,
    0.77-0.85 s in all (docs/results/moves.md; the factors are the parts' median ratios to the
    build). By hand: save 0.7 x 0.441 + 0.003 = 0.3117, teardown 0.1 x 0.441 = 0.0441, build
    0.6 x 0.441 = 0.2646, load 0.4 x 0.441 + 0.003 = 0.1794. Before the state was handed over
    in memory the same run's move took 1.39 s after a 0.264 s build (docs/results/replanning.md)."""
    from megatron_rlhf.planner.replan import move_estimate

    parts = move_estimate(0.441, 3e6)
    assert parts == pytest.approx({"save_s": 0.3117, "teardown_s": 0.0441, "build_s": 0.2646,
                                   "load_s": 0.1794}, abs=1e-9)
    measured = {"save_s": 0.326, "teardown_s": 0.044, "build_s": 0.251, "load_s": 0.173}
    assert all(parts[k] == pytest.approx(v, rel=0.08) for k, v in measured.items())
    assert 0.77 < sum(parts.values()) < 0.85
