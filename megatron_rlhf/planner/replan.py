"""Re-rank placements during a run from the stage times it measured.

    measured = Measured({"generation": 3.1, "training": 1.2}, step_seconds=5.0,
                        response_length=180.0)
    result = rerank(current, candidates, rollout, measured, profiles)
    result.best.label, result.gain, result.scales, result.predicted_vs_measured

The cost model's seconds per stage are off by factors that differ per stage (decoding on a CPU is
slower than its bandwidth says, a tiny model's training is all latency). ``calibrate`` finds one
factor per stage such that the run's own placement, predicted with them, takes the measured stage
times; ``rerank`` prices every candidate placement with the same factors and with the answers the
run really generates (``measured_rollout``: a length distribution of the measured mean, cut at
the longest answer measured or at ``max_new_tokens``, instead of every answer at the cap), and
ranks them; ``shapes_of`` fits the shapes to each plan where they depend on it (a run's token budgets set
its micro-batches by what shares a device). The factors are found again at every call from the
times given: nothing is carried over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from megatron_rlhf.planner.hardware import HardwareProfile
from megatron_rlhf.planner.memory_fit import MEMORY_OPTIONS
from megatron_rlhf.planner.predict import STAGES, StepPrediction, predict_step
from megatron_rlhf.planner.workload import AnswerLengths, RolloutSpec
from megatron_rlhf.topology.plan import PlacementPlan

CALIBRATION_PASSES = 4
"""Fixed-point passes of ``calibrate``: the schedule (overlaps, shared cores) makes a stage's
scheduled seconds a little off from its scaled cost, so each pass corrects the factors by what
the previous one missed."""

MOVE_PARTS_PER_BUILD = {"save_s": 0.7, "teardown_s": 0.1, "build_s": 0.6, "load_s": 0.4}
"""Fixed seconds of each part of a move, in units of the run's own start-up build: saving the
state (the optimizer's sharded state gathered, the shards kept in memory, the run files
written), tearing the run down (dropping models, freeing caches, destroying process groups),
building the new placement (warm: less than the first build) and loading the state (the shards
exchanged between the ranks, shadows synced). The medians of three moves of 4 gloo ranks of
``ppo_tiny`` sharing 2 loaded CPU cores (``benchmarks/move_cost.py``, docs/results/moves.md),
whose start-up builds took 0.38-0.49 s and whose moves took save 0.33, teardown 0.04, build
0.25, load 0.17 s on average; assumed elsewhere."""
MOVE_BYTES_PER_S = 1e9
"""Bytes per second assumed for copying out, and again for exchanging, the state in a move."""

Profiles = Mapping[str, HardwareProfile] | HardwareProfile | None
ShapesOf = Callable[[PlacementPlan, RolloutSpec], RolloutSpec]
"""The step's shapes at a plan, from the shapes measured (e.g. its micro-batch rows)."""


@dataclass(frozen=True)
class Measured:
    """What the run measured over its recent steps (means per step).

    Attributes:
        stage_seconds: wall-clock seconds per planner stage (``STAGES``); missing or zero
            stages keep the cost model's own seconds.
        step_seconds: seconds per step.
        response_length: mean generated tokens per answer.
        longest: the longest answer measured (None: not measured; the cap stands for it).
    """

    stage_seconds: dict[str, float]
    step_seconds: float
    response_length: float
    longest: float | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.stage_seconds) - set(STAGES))
        if unknown:
            raise ValueError(f"measured stages {unknown} are unknown: use {list(STAGES)}")


@dataclass(frozen=True)
class Priced:
    """One candidate priced with the measured lengths and the calibration."""

    label: str
    plan: PlacementPlan
    prediction: StepPrediction

    def to_dict(self) -> dict:
        """JSON-ready: label, predicted step seconds and seconds per stage."""
        p = self.prediction
        return {"label": self.label, "feasible": p.feasible,
                "step_seconds": round(p.step_seconds, 6) if p.feasible else None,
                "stage_seconds": {k: round(v, 6) for k, v in p.stage_seconds.items()}}


@dataclass(frozen=True)
class Replan:
    """The result of ``rerank``.

    Attributes:
        ranking: feasible candidates by increasing calibrated step seconds, then the others.
        current: the run's own placement, calibrated.
        best: the first of ``ranking`` (``current`` when no candidate is faster).
        gain: ``1 - best / current`` calibrated step seconds (0 when the current one is best).
        scales: the calibration factor per stage.
        predicted_vs_measured: per stage (and ``step``) of the current placement, the measured
            seconds and the predicted ones before and after the calibration.
        rollout: the shapes priced (answer lengths from the measured ones).
    """

    ranking: tuple[Priced, ...]
    current: Priced
    best: Priced
    gain: float
    scales: dict[str, float]
    predicted_vs_measured: dict[str, dict[str, float]]
    rollout: RolloutSpec


def move_estimate(build_seconds: float, state_bytes: float) -> dict[str, float]:
    """Seconds of each part of a first move (``save_s``, ``teardown_s``, ``build_s``,
    ``load_s``), before any was measured: the fixed parts ``MOVE_PARTS_PER_BUILD`` times the run's
    start-up build ``build_seconds``, and the state's ``state_bytes`` written and read again at
    ``MOVE_BYTES_PER_S``."""
    parts = {part: factor * build_seconds for part, factor in MOVE_PARTS_PER_BUILD.items()}
    parts["save_s"] += state_bytes / MOVE_BYTES_PER_S
    parts["load_s"] += state_bytes / MOVE_BYTES_PER_S
    return parts


def measured_rollout(rollout: RolloutSpec, response_length: float,
                     longest: float | None = None) -> RolloutSpec:
    """``rollout`` with the answers measured: exponentially spread lengths of mean
    ``response_length`` cut at ``longest`` (None: at ``rollout.generation_length``, the cap),
    which stays the cap (``AnswerLengths.from_mean_max``); every answer at the cap when the
    mean reaches it (answers forced to full length)."""
    cap = rollout.generation_length
    mean = min(max(1.0, response_length), float(cap))
    if round(mean) >= cap:
        return rollout.with_answer_lengths(None)
    cut = cap if longest is None else min(cap, max(round(longest), round(mean)))
    found = AnswerLengths.from_mean_max(mean, cut)
    return rollout.with_answer_lengths(
        AnswerLengths(found.lengths, cap, f"measured mean; {found.source}"))


def calibrate(plan: PlacementPlan, rollout: RolloutSpec, measured: Measured,
              profiles: Profiles = None, memory_options: tuple[str, ...] = MEMORY_OPTIONS,
              passes: int = CALIBRATION_PASSES
              ) -> tuple[dict[str, float], StepPrediction, StepPrediction]:
    """Factors per stage with which ``plan`` is predicted to take the measured stage times.

    Returns:
        The factors (1.0 for stages not measured or not predicted), the prediction before and
        the prediction after calibration.

    Raises:
        ValueError: ``plan`` does not fit in memory under the cost model (nothing to calibrate).
    """
    before = predict_step(plan, rollout, profiles, memory_options)
    if not before.feasible:
        raise ValueError(f"the run's placement does not fit under the cost model, so it cannot "
                         f"be calibrated: {list(before.problems)}")
    scales = dict.fromkeys(STAGES, 1.0)
    after = before
    for _ in range(passes):
        for stage, seconds in measured.stage_seconds.items():
            predicted = after.stage_seconds.get(stage, 0.0)
            if seconds > 0 and predicted > 0:
                scales[stage] *= seconds / predicted
        after = predict_step(plan, rollout, profiles, memory_options, stage_scale=scales)
    return scales, before, after


def rerank(current: tuple[str, PlacementPlan], candidates: Sequence[tuple[str, PlacementPlan]],
           rollout: RolloutSpec, measured: Measured, profiles: Profiles = None,
           memory_options: tuple[str, ...] = MEMORY_OPTIONS,
           shapes_of: ShapesOf | None = None) -> Replan:
    """Rank ``candidates`` by step seconds predicted with the run's measurements.

    Args:
        current: label and plan of the run's placement (the one measured).
        candidates: labels and plans to rank; the current one may be among them.
        rollout: the run's shapes; the generation length is replaced by the measured one.
        measured: the run's recent stage times and answer length.
        profiles: device profiles (``hardware.resolve_profiles``).
        memory_options: the memory options the planner may add.
        shapes_of: the shapes at each plan (None: the same at every plan).

    Raises:
        ValueError: the current placement does not fit under the cost model.
    """
    measured_shapes = measured_rollout(rollout, measured.response_length, measured.longest)

    def shapes(plan: PlacementPlan) -> RolloutSpec:
        return measured_shapes if shapes_of is None else shapes_of(plan, measured_shapes)

    scales, before, after = calibrate(current[1], shapes(current[1]), measured, profiles,
                                      memory_options)
    priced = [Priced(label, plan, predict_step(plan, shapes(plan), profiles, memory_options,
                                               stage_scale=scales))
              for label, plan in candidates]
    priced.sort(key=lambda c: (not c.prediction.feasible, c.prediction.step_seconds))
    mine = Priced(current[0], current[1], after)
    best = priced[0] if priced and priced[0].prediction.feasible else mine
    if best.prediction.step_seconds >= after.step_seconds:
        best = mine
    return Replan(tuple(priced), mine, best, 1.0 - best.prediction.step_seconds /
                  after.step_seconds, scales, _versus(measured, before, after),
                  shapes(current[1]))


def _versus(measured: Measured, before: StepPrediction,
            after: StepPrediction) -> dict[str, dict[str, float]]:
    """Measured against predicted seconds, per measured stage and for the step."""
    rows = {stage: (seconds, before.stage_seconds.get(stage, 0.0),
                    after.stage_seconds.get(stage, 0.0))
            for stage, seconds in measured.stage_seconds.items() if seconds > 0}
    rows["step"] = (measured.step_seconds, before.step_seconds, after.step_seconds)
    return {key: {"measured": round(m, 6), "predicted_before": round(b, 6),
                  "predicted_after": round(a, 6)}
            for key, (m, b, a) in rows.items() if math.isfinite(b)}
