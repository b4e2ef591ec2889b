"""Metric values with their reduction: combining over simulated ranks and micro-batches equals
the direct computation; an untyped or twice-typed metric is refused; the collective matches."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.runtime.metric_reduce import (
    Max,
    Mean,
    Min,
    Replicated,
    Sum,
    accumulate,
    all_reduce,
    detached,
    reduce,
    values,
)
from tests.multirank import run_on_ranks

TOKENS = [[0.5, 1.5, 2.0], [4.0], [-1.0, 3.0], [2.5, 2.5, 0.0, 1.0]]
"""Per-token values of four micro-batches, two on each of two simulated ranks."""


def _microbatch(tokens: list[float]) -> dict[str, object]:
    values_ = torch.tensor(tokens, dtype=torch.float64)
    count = torch.tensor(len(tokens))
    return {"loss": Mean(values_.mean() * count, count), "rows": Sum(1.0),
            "peak": Max(values_.max()), "low": Min(values_.min()),
            "reward_mean": Replicated(0.25)}


def test_combining_ranks_equals_the_direct_computation() -> None:
    ranks = [{}, {}]
    for index, tokens in enumerate(TOKENS):  # each rank reduces its micro-batches first
        accumulate(ranks[index // 2], _microbatch(tokens))
    got = values(reduce(ranks))
    every = [value for tokens in TOKENS for value in tokens]
    assert got == pytest.approx({"loss": sum(every) / len(every), "rows": 4.0,
                                 "peak": max(every), "low": min(every), "reward_mean": 0.25})
    assert all(isinstance(value, float) for value in got.values())


def test_a_sum_over_ranks_adds_in_the_order_given() -> None:
    parts = [0.1, 0.2, 0.3, 1e16, -1e16]
    total = 0.0
    for part in parts:
        total += part
    assert values(reduce({"x": Mean(part, 1.0)} for part in parts))["x"] == total / 5


def test_a_mean_without_weight_is_zero_and_replicated_keeps_the_first() -> None:
    assert values({"m": Mean(0.0, 0.0)}) == {"m": 0.0}
    assert values(reduce([{"r": Replicated(1.0)}, {"r": Replicated(2.0)}])) == {"r": 1.0}


def test_reduce_reads_tensors_to_floats_and_the_result_pickles() -> None:
    reduced = reduce([{"m": Mean(torch.tensor(3.0), torch.tensor(2))}])
    assert reduced == {"m": Mean(3.0, 2.0)} and type(reduced["m"].total) is float
    assert pickle.loads(pickle.dumps(reduced)) == reduced


def test_an_untyped_metric_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"metric 'actor/pg_loss_sum' is a float, not a metric"):
        reduce([{"actor/pg_loss_sum": 1.0}])
    with pytest.raises(TypeError, match=r"metric 'x' is a Tensor"):
        values({"x": torch.tensor(1.0)})


def test_one_name_reduced_two_ways_is_refused() -> None:
    with pytest.raises(TypeError, match=r"metric 'x' is reduced as Mean in one contribution "
                                        r"and as Max in another"):
        reduce([{"x": Mean(1.0)}, {"x": Max(2.0)}])


def test_detached_copies_the_tensors() -> None:
    loss = torch.tensor(2.0, requires_grad=True) * 3
    copy = detached(Mean(loss, torch.tensor(3)))
    loss.data /= 3  # megatron scales the returned loss in place
    assert copy.total.item() == 6.0 and not copy.total.requires_grad


def test_all_reduce_refuses_what_it_cannot_combine() -> None:
    with pytest.raises(TypeError, match=r"metric 'r': a Replicated cannot be all-reduced"):
        all_reduce([], {"r": Replicated}, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"lack \['loss'\]"):
        all_reduce([{"rows": Sum(1.0)}], {"loss": Mean, "rows": Sum}, None, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"metric 'loss' is a Sum, declared Mean"):
        all_reduce([{"loss": Sum(1.0)}], {"loss": Mean}, None, torch.device("cpu"))


KINDS = {"loss": Mean, "rows": Sum, "peak": Max, "low": Min}


def _all_reduced(with_last_rank_empty: bool) -> dict[str, float]:
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = [] if with_last_rank_empty and rank == size - 1 else TOKENS[rank::size]
    metrics = [{name: value for name, value in _microbatch(tokens).items() if name in KINDS}
               for tokens in mine]
    return values(all_reduce(metrics, KINDS, None, torch.device("cpu")))


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_the_collective_equals_the_direct_computation() -> None:
    full, partial = (run_on_ranks(_all_reduced, world_size=2, args=(empty,), timeout_s=60)
                     for empty in (False, True))
    every = [value for tokens in TOKENS for value in tokens]
    assert full[0] == full[1] == pytest.approx({"loss": sum(every) / len(every), "rows": 4.0,
                                                "peak": max(every), "low": min(every)})
    kept = [value for tokens in TOKENS[0::2] for value in tokens]  # rank 1 had none
    assert partial[0] == partial[1] == pytest.approx({"loss": sum(kept) / len(kept), "rows": 2.0,
                                                      "peak": max(kept), "low": min(kept)})
    assert not any(math.isinf(value) for value in partial[0].values())
