"""Clusters and a plan-invariant check shared by the topology tests."""

from __future__ import annotations

from megatron_rlhf.topology import ClusterSpec, DevicePool, PlacementPlan
from megatron_rlhf.topology.models import TRAINABLE_ROLES
from megatron_rlhf.topology.placement_config import DISJOINT_ROLES

HETERO = ClusterSpec((
    DevicePool("A100-80GB", nodes=1, devices_per_node=8, memory_gib=80, relative_speed=1.0),
    DevicePool("V100-32GB", nodes=2, devices_per_node=4, memory_gib=32, relative_speed=0.4),
))

CLUSTERS = {
    "1x8": ClusterSpec.homogeneous(1, 8),
    "2x8": ClusterSpec.homogeneous(2, 8),
    "4x8": ClusterSpec.homogeneous(4, 8),
    "16x8": ClusterSpec.homogeneous(16, 8),
    "hetero": HETERO,
}


def check_invariants(plan: PlacementPlan) -> None:
    """Assert, independently of ``validate_plan``, what every plan must satisfy."""
    node_of = {rank: node for node in plan.cluster.nodes() for rank in node.ranks}
    for role, model in plan.models.items():
        assert model.role == role
        assert 0 <= model.ranks.start < model.ranks.stop <= plan.world_size
        assert model.tp * model.pp * model.dp == model.size
        nodes = sorted({node_of[r].index for r in model.ranks})
        if len(nodes) > 1:  # whole nodes only
            for rank in model.ranks:
                assert set(node_of[rank].ranks) <= set(model.ranks), (role, rank)
        for group in model.group_ranks("tp"):
            assert len({node_of[r].index for r in group}) == 1, (role, group)
        for rank in model.ranks:
            c = model.coords(rank)
            assert model.global_rank(c.tp, c.dp, c.pp) == rank
    for left, right in DISJOINT_ROLES.get(plan.config.strategy, ()):
        if left in plan.models and right in plan.models:
            assert not set(plan[left].ranks) & set(plan[right].ranks), (left, right)
    if plan.config.separated:
        train = set().union(*(plan[r].ranks for r in TRAINABLE_ROLES if r in plan.models))
        for role in plan.roles:
            if role not in TRAINABLE_ROLES:
                assert not train & set(plan[role].ranks), role
