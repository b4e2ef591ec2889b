"""Every process group of 16x8 plans, built in one process on the fake backend (topology only)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_rlhf.topology import ClusterSpec, PlacementConfig, plan_placement
from megatron_rlhf.topology.groups import build_process_groups
from tests.topology.groups_check import check_rank_groups, expected_groups

CLUSTER = ClusterSpec.homogeneous(16, 8)
CONFIGS = [
    (PlacementConfig("separation", tp=8), "llama-65b"),
    (PlacementConfig("interleaving", tp=2, pp=4, ac_share=True), "llama-7b"),
    (PlacementConfig("interleaving2", tp=4, pp=2), "llama-13b"),
]


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch):
    """``start(rank)`` makes this process rank ``rank`` of a fake 128-rank world."""
    monkeypatch.setenv("WORLD_SIZE", str(CLUSTER.world_size))

    def start(rank: int) -> None:
        dist.init_process_group("fake", rank=rank, world_size=CLUSTER.world_size,
                                store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_rank_of_16x8_plans_gets_the_planned_groups(fake_world) -> None:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    plans = [plan_placement(CLUSTER, config, model) for config, model in CONFIGS]
    expected = [expected_groups(plan) for plan in plans]
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    checked = 0
    for rank in range(CLUSTER.world_size):
        fake_world(rank)
        for plan, members in zip(plans, expected, strict=True):
            groups = build_process_groups(plan, timeout=datetime.timedelta(seconds=60))
            checked += check_rank_groups(plan, members, groups)
            for pgs in filter(None, groups.values()):
                found = ProcessGroupCollection.setup_process_groups_for_ddp(pgs, None, ddp_config)
                assert found["dp_group"] is pgs.dp and found["inter_dist_opt_group"] is None
        dist.destroy_process_group()
    assert checked > 128 * 3 * 19


def test_plan_must_match_the_world(fake_world) -> None:
    fake_world(0)
    small = plan_placement(ClusterSpec.homogeneous(1, 8), PlacementConfig(), "tiny")
    with pytest.raises(ValueError, match="the plan covers 8 ranks but the default process group "
                                         "has 128"):
        build_process_groups(small)


def test_group_creations_at_128_ranks_are_one_split_per_grid_dimension(
        fake_world, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL each creation is a world-wide communicator split: with ``split_group`` a
    dimension's replicas (128 single-rank groups, say) are one call, not one each."""
    import megatron_rlhf.topology.groups as groups_module

    plan = plan_placement(CLUSTER, *CONFIGS[0])
    created: list[list[list[int]]] = []

    def split_group(split_ranks, timeout, group_desc):  # the fake backend cannot split
        created.append(split_ranks)
        mine = None
        for ranks in split_ranks:
            group = dist.new_group(ranks, timeout=timeout, group_desc=group_desc)
            mine = group if dist.get_rank() in ranks else mine
        return mine

    counts = {}
    for split in (False, True):
        monkeypatch.setattr(groups_module, "supports_split_group", lambda split=split: split)
        monkeypatch.setattr(dist, "split_group", split_group)
        fake_world(5)
        new_group_calls = []
        original = dist.new_group
        monkeypatch.setattr(dist, "new_group", lambda *a, calls=new_group_calls, create=original,
                            **k: calls.append(a) or create(*a, **k))
        groups = build_process_groups(plan, timeout=datetime.timedelta(seconds=60))
        assert check_rank_groups(plan, expected_groups(plan), groups) > 0
        counts[split] = (len(new_group_calls), len(created))
        monkeypatch.setattr(dist, "new_group", original)
        dist.destroy_process_group()
    print("group creation calls at 128 ranks (new_group, split_group):", counts)
    memberships, _ = counts[False]
    # every membership is created once either way; with splits, a call per new dimension
    assert counts[True][0] == memberships
    assert sum(map(len, created)) == memberships
    assert counts[True][1] <= 10 * len(plan.roles) < memberships / 2, counts


def test_expert_parallel_models_get_megatrons_expert_groups(fake_world) -> None:
    """``placement.parallel.actor.ep=2`` at tp=2, pp=2 under flattening on 16 x 8 (dp=32): the
    actor's collection carries the expert grid's groups; the ref, without ep, the dense
    defaults."""
    from megatron_rlhf.topology.experts import expert_rank_enums
    from megatron_rlhf.topology.placement_config import ParallelOverride

    plan = plan_placement(CLUSTER, PlacementConfig(tp=2, pp=2, parallel={
        "actor": ParallelOverride(ep=2)}), "llama-7b")
    assert plan["actor"].dp == 32
    enums = expert_rank_enums(0, tp=2, dp=32, pp=2, ep=2)
    for rank in range(0, CLUSTER.world_size, 5):
        fake_world(rank)
        groups = build_process_groups(plan)
        actor, ref = groups["actor"], groups["ref"]
        for name in ("ep", "expt_dp", "tp_ep", "tp_ep_pp"):
            (members,) = [ranks for ranks in enums[name] if rank in ranks]
            assert dist.get_process_group_ranks(getattr(actor, name)) == members, (rank, name)
        assert actor.intra_expt_dp is actor.expt_dp
        assert dist.get_process_group_ranks(actor.ep) == [rank & ~2, rank | 2]  # dp ranks
        assert ref.ep.size() == 1 and ref.expt_dp is ref.dp and ref.tp_ep is ref.tp
        dist.destroy_process_group()
