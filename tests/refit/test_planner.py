"""The refit planner, with no process group: coverage, source choice and errors."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from megatron_rlhf.refit import ModelLayout, plan_refit
from megatron_rlhf.refit.layout import box_numel
from tests.refit.fake_model import describe, simulate

L = ModelLayout

LAYOUT_PAIRS = {
    "tp2->tp1xdp2 disjoint": (L(0, tp=2), L(2, tp=1, dp=2)),
    "tp2pp2->tp4 disjoint": (L(0, tp=2, pp=2), L(4, tp=4)),
    "tp1->tp2 (vocab padding grows)": (L(0, tp=1), L(1, tp=2)),
    "tp4->tp1 (vocab padding shrinks)": (L(0, tp=4), L(4, tp=1)),
    "tp1pp2->tp2 disjoint": (L(0, tp=1, pp=2), L(2, tp=2)),
    "tp2xdp2->tp4 overlapping": (L(0, tp=2, dp=2), L(0, tp=4)),
    "tp2xdp2->tp1xdp4 overlapping": (L(0, tp=2, dp=2), L(0, tp=1, dp=4)),
    "tp4->tp2pp2 overlapping": (L(0, tp=4), L(0, tp=2, pp=2)),
    "tp2xdp2->tp2xdp2 same ranks": (L(0, tp=2, dp=2), L(0, tp=2, dp=2)),
}


@pytest.mark.parametrize("name", list(LAYOUT_PAIRS))
@pytest.mark.parametrize("tied", [False, True])
def test_plan_reproduces_the_source_on_every_destination_rank(name: str, tied: bool) -> None:
    src_layout, dst_layout = LAYOUT_PAIRS[name]
    src, dst = describe(src_layout, tied=tied), describe(dst_layout, tied=tied)
    plan = plan_refit(src, dst)
    simulate(plan, src, dst)
    assert [t.task_id for t in plan.transfers] == list(range(len(plan.transfers)))


def _copies_used(plan, src_layout: ModelLayout) -> dict[tuple[int, str], set]:
    used = defaultdict(set)
    for t in plan.transfers:
        c = src_layout.coords(t.src_rank)
        used[(t.dst_rank, t.dst_name)].add((c.dp, c.pp))
    return used


def test_each_destination_shard_reads_one_source_replica() -> None:
    src_layout, dst_layout = L(0, tp=2, dp=2), L(4, tp=1, dp=2)
    plan = plan_refit(describe(src_layout), describe(dst_layout))
    assert all(len(copies) == 1 for copies in _copies_used(plan, src_layout).values())


def test_same_rank_source_is_a_local_copy() -> None:
    same = plan_refit(describe(L(0, tp=2, dp=2)), describe(L(0, tp=2, dp=2)))
    assert all(t.is_local for t in same.transfers) and same.remote_elements_sent() == {}
    # TP2 x DP2 -> TP4 on the same ranks: TP4 shard r sits inside TP2 shard r // 2, held by
    # ranks {0, 2} or {1, 3}; ranks 0 and 3 find theirs locally.
    plan = plan_refit(describe(L(0, tp=2, dp=2)), describe(L(0, tp=4)))
    qkv = [t for t in plan.transfers if t.dst_name.endswith("linear_qkv.weight")]
    assert {t.dst_rank for t in qkv if t.is_local} == {0, 3}


def test_load_is_balanced_across_source_replicas() -> None:
    plan = plan_refit(describe(L(0, tp=1, dp=2)), describe(L(2, tp=1, dp=2)))
    sent = plan.remote_elements_sent()
    assert set(sent) == {0, 1}
    assert max(sent.values()) <= 1.25 * min(sent.values())
    total = sum(box_numel(tuple((0, n) for n in p.shape)) for r in describe(L(2, tp=1, dp=2))
                for p in r.params)
    padding = sum(box_numel(z.box) for z in plan.zero_fills)
    assert sum(sent.values()) == total - padding


def test_padded_vocabulary_rows_are_zero_filled() -> None:
    # vocab 10: TP1 pads to 12 rows; TP4 to 16 rows (4 per rank), so rank 3 is all padding.
    plan = plan_refit(describe(L(0, tp=1)), describe(L(1, tp=4)))
    fills = {(z.rank, z.local_name): z.box for z in plan.zero_fills}
    assert fills[(3, "embedding.word_embeddings.weight")] == ((2, 4), (0, 8))
    assert fills[(4, "output_layer.weight")] == ((0, 4), (0, 8))
    assert not [t for t in plan.transfers if t.dst_rank == 4 and t.dst_name == "output_layer.weight"]


def test_glu_halves_map_gate_and_up_separately() -> None:
    plan = plan_refit(describe(L(0, tp=2), num_layers=1), describe(L(2, tp=1), num_layers=1))
    fc1 = sorted((t.src_rank, t.src_box[0], t.dst_box[0]) for t in plan.transfers
                 if t.dst_name.endswith("linear_fc1.weight"))
    # FFN 12: each TP2 shard is [gate 6 rows; up 6 rows]; TP1 holds [gate 12; up 12].
    assert fc1 == [(0, (0, 6), (0, 6)), (0, (6, 12), (12, 18)),
                   (1, (0, 6), (6, 12)), (1, (6, 12), (18, 24))]


def test_missing_parameter_names_the_parameter() -> None:
    src = describe(L(0, tp=1))
    dst = describe(L(1, tp=1), tied=True)
    src_no_head = [dataclasses.replace(r, params=tuple(p for p in r.params
                                                       if "final_layernorm" not in p.local_name))
                   for r in src]
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight.*has no source"):
        plan_refit(src_no_head, dst)


def test_dtype_and_shape_mismatch_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype torch.bfloat16 differs"):
        plan_refit(describe(L(0)), describe(L(1), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="full shape"):
        plan_refit(describe(L(0)), describe(L(1, tp=2), num_layers=4)[:1] + [
            dataclasses.replace(describe(L(1, tp=2))[1], tp_size=4)])


def test_incomplete_source_copy_is_refused() -> None:
    src = describe(L(0, tp=2))[:1]  # TP rank 1 missing
    with pytest.raises(ValueError, match="covers .* of the .* elements"):
        plan_refit(src, describe(L(2, tp=1)))
