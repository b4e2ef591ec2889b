"""Row transfers between model layouts: the pure planner, and its execution on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.engine.transfer import RowLayout, Transfer, plan_transfers
from tests.multirank import run_on_ranks


def _rows_received(plan: list[Transfer], rank: int) -> list[int]:
    return sorted(row for t in plan if t.dst == rank for row in range(t.start, t.end))


def test_every_needed_row_arrives_exactly_once_from_a_holder() -> None:
    source = RowLayout.sharded(12, [[0, 1], [2, 3]])  # a TP2 x DP2 model's outputs
    target = RowLayout.sharded(12, [[4], [5], [6]])  # a DP3 model on other ranks
    plan = plan_transfers(source, target)
    for rank, (start, end) in target.rows.items():
        assert _rows_received(plan, rank) == list(range(start, end))
    for t in plan:
        s, e = source.rows[t.src]
        assert s <= t.start and t.end <= e


def test_local_rows_are_copied_not_sent() -> None:
    source = RowLayout.sharded(8, [[0], [1]])
    target = RowLayout.replicated(8, [0, 1])
    plan = plan_transfers(source, target)
    assert Transfer(0, 0, 0, 4) in plan and Transfer(1, 1, 4, 8) in plan
    assert Transfer(1, 0, 4, 8) in plan and Transfer(0, 1, 0, 4) in plan


def test_sources_are_balanced_and_prefer_the_same_node() -> None:
    source = RowLayout.replicated(8, [0, 1, 2, 3])  # four holders of everything
    target = RowLayout.sharded(8, [[4], [5], [6], [7]])
    plan = plan_transfers(source, target)
    assert sorted(t.src for t in plan) == [0, 1, 2, 3]
    node_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}.__getitem__
    near = plan_transfers(RowLayout.replicated(8, [0, 1, 2, 3]),
                          RowLayout.replicated(8, [4]), node_of=node_of)
    assert {t.src for t in near} == {2}


def test_unheld_rows_and_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="held by no rank"):
        plan_transfers(RowLayout(8, {0: (0, 4)}), RowLayout.replicated(8, [1]))
    with pytest.raises(ValueError, match="does not split"):
        RowLayout.sharded(7, [[0], [1]])
    with pytest.raises(ValueError, match="outside a batch"):
        RowLayout(4, {0: (2, 6)})


def _move_between_models() -> list[float]:
    from megatron_rlhf.engine.transfer import execute_transfers

    rank = dist.get_rank()
    full = {"ids": torch.arange(24).view(8, 3), "score": torch.linspace(0, 1, 8)}
    schema = {"ids": (torch.int64, (3,)), "score": (torch.float32, ())}
    source = RowLayout.sharded(8, [[0, 1], [2, 3]])  # outputs of a TP2 x DP2 model
    target = RowLayout.sharded(8, [[3], [2], [1], [0]])  # a DP4 model, replicas reversed
    held = source.held_by(rank)
    mine = {k: v[held[0]:held[1]] for k, v in full.items()}
    # A model computing in bf16 may hold a field in a narrower dtype than the schema's: the
    # sender converts, or the receiver would read half a buffer of misinterpreted bytes.
    mine["score"] = mine["score"].bfloat16()
    full["score"] = full["score"].bfloat16().float()
    plan = plan_transfers(source, target)
    got = execute_transfers(plan, source, target, mine, schema)
    start, end = target.held_by(rank)
    assert torch.equal(got["ids"], full["ids"][start:end])
    assert got["score"].dtype == torch.float32
    assert torch.equal(got["score"], full["score"][start:end])
    back = execute_transfers(plan_transfers(target, RowLayout.replicated(8, [0])), target,
                             RowLayout.replicated(8, [0]), got, schema)
    return back["score"].tolist() if back is not None else []


@pytest.mark.multirank
def test_execution_moves_rows_between_layouts() -> None:
    results = run_on_ranks(_move_between_models, world_size=4, timeout_s=60)
    assert results[0] == torch.linspace(0, 1, 8).bfloat16().float().tolist()
    assert results[1:] == [[], [], []]
