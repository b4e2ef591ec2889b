"""Hold predictions against measurements: per-stage ratios and ranking agreement.

    ratios = compare_stage_times(prediction, {"generation": 3.1, "training": 1.2, "step": 5.0})
    within_factor(ratios, 3.0)          # every predicted/measured ratio in [1/3, 3]
    report = compare_rankings({"flattening": 2.0, "separation": 2.6},     # predicted samples/s
                              {"flattening": 1.1, "separation": 1.5})     # measured samples/s
    report.same_order, report.kendall_tau
    report = compare_rankings({"flattening": 2.0, "separation": 2.6},
                              {"flattening": 1.1, "separation": 1.5},     # medians of runs
                              measured_range={"flattening": (1.0, 1.2), "separation": (1.3, 1.6)})
    report.ties, report.separable_agree  # pairs whose runs overlap; every other pair in order
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_rlhf.planner.predict import StepPrediction


def compare_stage_times(prediction: StepPrediction,
                        measured: Mapping[str, float]) -> dict[str, float]:
    """Predicted / measured seconds for every stage measured (and ``step`` for the whole step).

    Args:
        prediction: a feasible prediction.
        measured: seconds keyed by stage name (``generation``, ``experience``, ``training``,
            ``transfer``, ``sync``) and optionally ``step``; zero or missing entries are skipped.

    Raises:
        ValueError: the prediction is infeasible, or a key is neither a stage nor ``step``.
    """
    if not prediction.feasible:
        raise ValueError("the prediction is infeasible (no times): fix its problems first: "
                         f"{list(prediction.problems)}")
    predicted = {**prediction.stage_seconds, "step": prediction.step_seconds}
    unknown = sorted(set(measured) - set(predicted))
    if unknown:
        raise ValueError(f"measured has unknown keys {unknown}: use {sorted(predicted)}")
    return {key: predicted[key] / value for key, value in measured.items() if value > 0}


def within_factor(ratios: Mapping[str, float], factor: float) -> bool:
    """Whether every ratio lies in ``[1 / factor, factor]``."""
    if factor < 1:
        raise ValueError(f"factor={factor} must be >= 1")
    return all(1 / factor <= ratio <= factor for ratio in ratios.values())


@dataclass(frozen=True)
class RankingComparison:
    """Predicted against measured ranking of placements.

    Attributes:
        predicted_order: names by decreasing predicted samples/s.
        measured_order: names by decreasing measured samples/s.
        kendall_tau: rank correlation in [-1, 1] over all pairs (1: same order).
        same_order: the two orders are identical.
        ratios: predicted / measured samples/s per name.
        ties: pairs the measurement cannot order: their runs overlap (the lowest of one is below
            the highest of the other); empty when no ranges are given.
        separable_agree: the prediction orders every pair that is not a tie as measured.
    """

    predicted_order: tuple[str, ...]
    measured_order: tuple[str, ...]
    kendall_tau: float
    same_order: bool
    ratios: dict[str, float]
    ties: tuple[tuple[str, str], ...] = ()
    separable_agree: bool = False


def compare_rankings(predicted: Mapping[str, float], measured: Mapping[str, float],
                     measured_range: Mapping[str, tuple[float, float]] | None = None
                     ) -> RankingComparison:
    """Compare the ranking of placements by predicted and by measured samples/s.

    Args:
        predicted: samples/s per placement name.
        measured: samples/s per placement name (e.g. the median of repeated runs), same names.
        measured_range: optional (lowest, highest) measured samples/s per name over repeated
            runs. Two placements whose runs overlap are a tie: the measurement does not order
            them, so neither order of the prediction is checked against it.

    Raises:
        ValueError: the names differ, fewer than two are given, or a range misses a name or
            does not contain its measurement.
    """
    if set(predicted) != set(measured) or len(predicted) < 2:
        raise ValueError(f"predicted {sorted(predicted)} and measured {sorted(measured)} must "
                         "name the same two or more placements")
    spread = dict(measured_range or {})
    if spread and set(spread) != set(measured):
        raise ValueError(f"measured_range names {sorted(spread)}; it must name "
                         f"{sorted(measured)}")
    outside = [n for n, (low, high) in spread.items() if not low <= measured[n] <= high]
    if outside:
        raise ValueError(f"measured samples/s of {outside} lie outside their measured_range")
    names = sorted(predicted)
    concordant = discordant = 0
    ties, disagree = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sign = (predicted[a] - predicted[b]) * (measured[a] - measured[b])
            concordant += sign > 0
            discordant += sign < 0
            if spread and max(spread[a][0], spread[b][0]) <= min(spread[a][1], spread[b][1]):
                ties.append((a, b))
            elif sign <= 0:
                disagree.append((a, b))
    pairs = len(names) * (len(names) - 1) / 2
    predicted_order = tuple(sorted(names, key=lambda n: -predicted[n]))
    measured_order = tuple(sorted(names, key=lambda n: -measured[n]))
    return RankingComparison(
        predicted_order=predicted_order, measured_order=measured_order,
        kendall_tau=(concordant - discordant) / pairs,
        same_order=predicted_order == measured_order,
        ratios={n: predicted[n] / measured[n] for n in names if measured[n] > 0},
        ties=tuple(ties), separable_agree=not disagree,
    )

