"""On 4 and 8 gloo ranks: each process's groups, ranks and sizes match the plan, for every preset
that fits, and collectives on them work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.topology import ClusterSpec, DevicePool, PlacementConfig, plan_placement
from megatron_rlhf.topology.groups import build_process_groups
from tests.multirank import run_on_ranks
from tests.topology.groups_check import check_rank_groups, expected_groups


def _hetero(fast_nodes: int, fast_devices: int, slow_nodes: int, slow_devices: int
            ) -> ClusterSpec:
    return ClusterSpec((DevicePool("fast", fast_nodes, fast_devices, 80, 1.0),
                        DevicePool("slow", slow_nodes, slow_devices, 32, 0.5)))


CASES = {
    4: [
        (ClusterSpec.homogeneous(1, 4), PlacementConfig("flattening", tp=2)),
        (ClusterSpec.homogeneous(1, 4), PlacementConfig("interleaving", tp=2)),
        (ClusterSpec.homogeneous(1, 4), PlacementConfig("interleaving2", tp=2)),
        (ClusterSpec.homogeneous(1, 4), PlacementConfig("separation", tp=2)),
        (ClusterSpec.homogeneous(1, 4), PlacementConfig("custom", ratios=[1, 0.5, 0.5, 0.25])),
        (ClusterSpec.homogeneous(1, 4), PlacementConfig("interleaving", pp=2, ac_share=True)),
        (ClusterSpec.homogeneous(2, 2), PlacementConfig("separation", pp=2)),
        (_hetero(1, 2, 1, 2), PlacementConfig("hetero-separation", tp=2)),
    ],
    8: [
        (ClusterSpec.homogeneous(1, 8), PlacementConfig("flattening", tp=2, pp=2)),
        (ClusterSpec.homogeneous(1, 8), PlacementConfig("interleaving", tp=2, pp=2)),
        (ClusterSpec.homogeneous(1, 8), PlacementConfig("interleaving2", tp=2)),
        (ClusterSpec.homogeneous(1, 8), PlacementConfig("separation", tp=4)),
        (ClusterSpec.homogeneous(2, 4), PlacementConfig("separation", tp=2, pp=2)),
        (ClusterSpec.homogeneous(2, 4), PlacementConfig("interleaving2", tp=4, ac_share=True)),
        (_hetero(1, 4, 2, 2), PlacementConfig("hetero-separation", tp=2)),
        (_hetero(1, 4, 2, 2), PlacementConfig("flattening", tp=2)),
    ],
}


def _check_cases(world_size: int) -> int:
    checked = 0
    for cluster, config in CASES[world_size]:
        plan = plan_placement(cluster, config, "tiny")
        groups = build_process_groups(plan, timeout=60)
        checked += check_rank_groups(plan, expected_groups(plan), groups)
        for role in groups.local_roles:
            for group, size in ((groups.world(role), plan[role].size),
                                (groups[role].tp, plan[role].tp)):
                value = torch.ones(1)
                dist.all_reduce(value, group=group)
                assert value.item() == size, (config.strategy, role)
    return checked


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [4, 8])
def test_groups_match_the_plan_on_gloo(world_size: int) -> None:
    checked = run_on_ranks(_check_cases, world_size, args=(world_size,), timeout_s=240)
    assert all(count > 0 for count in checked)
