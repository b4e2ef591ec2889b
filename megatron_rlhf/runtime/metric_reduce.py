"""Metric values that carry how they combine over micro-batches, updates and ranks.

Whoever produces a metric says how it reduces by its type, so no name or suffix carries meaning:

    {"pg_loss": Mean(loss * count, count), "grad_norm": Mean(norm),
     "memory/train_peak_bytes": Max(peak), "reward_mean": Replicated(mean)}

:func:`reduce` combines any number of contributions by name, in the order given (micro-batches,
then ranks, as the callers pass them: sums are added in that order), and :func:`values` gives the
logged numbers. :func:`all_reduce` does the same with one collective over a process group. A name
reduced two ways, or a value of no metric type, is refused with a ``TypeError`` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

Number = float | torch.Tensor
"""A scalar: a float, or a 0-d tensor inside a loss function (read to the host by
:func:`reduce`, after the step, not during it)."""


@dataclass(frozen=True)
class Mean:
    """A weighted mean, ``total / weight`` (0 with no weight): totals and weights add.

    A per-token mean over a micro-batch is ``Mean(mean * tokens, tokens)``; a value of which the
    mean over updates or replicas is logged is ``Mean(value)``.
    """

    total: Number
    weight: Number = 1.0

    def combine(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.weight + other.weight)

    @property
    def value(self) -> float:
        return float(self.total) / float(self.weight) if self.weight else 0.0


@dataclass(frozen=True)
class Sum:
    """A total: values add."""

    value: Number

    def combine(self, other: Sum) -> Sum:
        return Sum(self.value + other.value)


@dataclass(frozen=True)
class Max:
    """The largest value (a peak)."""

    value: Number

    def combine(self, other: Max) -> Max:
        return Max(max(self.value, other.value))


@dataclass(frozen=True)
class Min:
    """The smallest value."""

    value: Number

    def combine(self, other: Min) -> Min:
        return Min(min(self.value, other.value))


@dataclass(frozen=True)
class Replicated:
    """A value every rank that reports it computed from the same data (the experience's metrics,
    from the whole batch): combining keeps the first."""

    value: Number

    def combine(self, other: Replicated) -> Replicated:
        return self


Metric = Mean | Sum | Max | Min | Replicated
METRIC_TYPES = (Mean, Sum, Max, Min, Replicated)


def checked(name: str, value: object) -> Metric:
    """``value``, if it is a metric value; else a ``TypeError`` naming ``name``."""
    if not isinstance(value, METRIC_TYPES):
        raise TypeError(f"metric {name!r} is a {type(value).__name__}, not a metric value: "
                        f"declare how it combines where it is produced (one of "
                        f"{', '.join(kind.__name__ for kind in METRIC_TYPES)}, "
                        "megatron_rlhf.runtime.metric_reduce)")
    return value


def combine(name: str, first: Metric, second: Metric) -> Metric:
    """Two contributions to metric ``name``, combined; refuses two different reductions."""
    if type(first) is not type(second):
        raise TypeError(f"metric {name!r} is reduced as {type(first).__name__} in one "
                        f"contribution and as {type(second).__name__} in another: give it one "
                        "reduction wherever it is produced")
    return first.combine(second)


def on_host(value: Metric) -> Metric:
    """``value`` with its tensors read as floats."""
    return dataclasses.replace(value, **{field.name: float(getattr(value, field.name))
                                         for field in dataclasses.fields(value)})


def detached(value: Metric) -> Metric:
    """``value`` with its tensors detached and copied (megatron scales a returned loss in place:
    a metric that aliased it would change)."""
    return dataclasses.replace(value, **{
        field.name: (item.detach().clone() if isinstance(item, torch.Tensor) else item)
        for field in dataclasses.fields(value) for item in [getattr(value, field.name)]})


def accumulate(into: dict[str, Metric], metrics: Mapping[str, object]) -> dict[str, Metric]:
    """Add one contribution to ``into`` (in place, and returned), each value read to the host."""
    for name, value in metrics.items():
        value = on_host(checked(name, value))
        into[name] = combine(name, into[name], value) if name in into else value
    return into


def reduce(contributions: Iterable[Mapping[str, object]]) -> dict[str, Metric]:
    """Every contribution combined by name, in order."""
    reduced: dict[str, Metric] = {}
    for metrics in contributions:
        accumulate(reduced, metrics)
    return reduced


def values(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """The logged number of each metric."""
    return {name: float(checked(name, value).value) for name, value in metrics.items()}


_ADDED = {Mean: ("total", "weight"), Sum: ("value",)}
"""Fields that add over ranks (one SUM all-reduce); Max and Min take one MAX all-reduce (Min
negated)."""


def all_reduce(per_microbatch: Sequence[Mapping[str, object]],
               kinds: Mapping[str, type], group: dist.ProcessGroup | None,
               device: torch.device) -> dict[str, Metric]:
    """The metrics of every micro-batch of every rank of ``group``, combined onto each rank.

    Every rank calls it with the same ``kinds``; a rank that computed no metrics (not a last
    pipeline stage, or a TP rank but the first) passes ``[]``. Sums are taken in float64.

    Args:
        per_microbatch: this rank's metrics of each micro-batch.
        kinds: the name and type (:class:`Mean`, :class:`Sum`, :class:`Max`, :class:`Min`) of
            every metric.
        group: the ranks combined (None: the default group).
    """
    for name, kind in kinds.items():
        if kind not in (*_ADDED, Max, Min):
            raise TypeError(f"metric {name!r}: a {getattr(kind, '__name__', kind)} cannot be "
                            "all-reduced; declare it Mean, Sum, Max or Min")
    added = [(name, field) for name, kind in kinds.items() for field in _ADDED.get(kind, ())]
    extreme = [(name, kind) for name, kind in kinds.items() if kind in (Max, Min)]
    rows, peaks = [], []
    for metrics in per_microbatch:
        if missing := [name for name in kinds if name not in metrics]:
            raise ValueError(f"a micro-batch's metrics lack {missing} (declared: {list(kinds)})")
        given = {name: checked(name, metrics[name]) for name in kinds}
        for name, value in given.items():
            if type(value) is not kinds[name]:
                raise TypeError(f"metric {name!r} is a {type(value).__name__}, declared "
                                f"{kinds[name].__name__}")
        rows.append([float(getattr(given[name], field)) for name, field in added])
        peaks.append([float(given[name].value) * (1 if kind is Max else -1)
                      for name, kind in extreme])
    sums = torch.tensor(rows, dtype=torch.float64, device=device).reshape(-1, len(added)).sum(0)
    dist.all_reduce(sums, group=group)
    tops = torch.full((len(extreme),), -torch.inf, dtype=torch.float64, device=device)
    if extreme:
        if peaks:
            tops = torch.tensor(peaks, dtype=torch.float64, device=device).amax(0)
        dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=group)
    found = dict(zip(added, sums.tolist(), strict=True))
    reduced: dict[str, Metric] = {}
    for name, kind in kinds.items():
        if kind is Mean:
            reduced[name] = Mean(found[name, "total"], found[name, "weight"])
        elif kind is Sum:
            reduced[name] = Sum(found[name, "value"])
    for (name, kind), top in zip(extreme, tops.tolist(), strict=True):
        reduced[name] = kind(top if kind is Max else -top)
    return reduced
