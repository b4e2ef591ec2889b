"""Compare this rank's process groups with the plan; shared by the fake-backend and gloo tests."""

from __future__ import annotations

import torch.distributed as dist

from megatron_rlhf.topology import PlacementPlan
from megatron_rlhf.topology.groups import RankProcessGroups

# ProcessGroupCollection field -> grid dimensions whose group it must equal (cp = ep = 1).
FIELD_DIMS = {
    "tp": ["tp"], "pp": ["pp"], "dp": ["dp"], "cp": ["cp"], "mp": ["tp", "pp"],
    "tp_cp": ["tp"], "dp_cp": ["dp"], "intra_dp_cp": ["dp"], "tp_dp_cp": ["tp", "dp"],
    "ep": ["cp"], "expt_tp": ["tp"], "tp_ep": ["tp"], "tp_ep_pp": ["tp", "pp"],
    "expt_dp": ["dp"], "intra_expt_dp": ["dp"], "intra_dist_opt": ["tp", "dp", "pp"],
    "embd": None, "pos_embd": None,
}

Expected = dict[str, dict[str, dict[int, list[int]]]]


def expected_groups(plan: PlacementPlan) -> Expected:
    """role -> collection field -> rank -> members of that rank's group (absent: no group)."""
    result: Expected = {}
    for role in plan.roles:
        model = plan[role]
        result[role] = {}
        for name, dims in FIELD_DIMS.items():
            if name == "embd":
                groups = model.embedding_ranks()
            elif name == "pos_embd":
                groups = model.position_embedding_ranks()
            else:
                groups = model.group_ranks(dims)
            result[role][name] = {rank: group for group in groups for rank in group}
    return result


def check_rank_groups(plan: PlacementPlan, expected: Expected, groups: RankProcessGroups) -> int:
    """Assert every group of this rank matches the plan; return the number of groups checked."""
    rank = dist.get_rank()
    assert set(groups) == set(plan.roles)
    assert groups.local_roles == plan.roles_on(rank)
    checked = 0
    for role in plan.roles:
        model, pgs = plan[role], groups[role]
        if not model.holds(rank):
            assert pgs is None and groups.world(role) is None, role
            continue
        for name, members in expected[role].items():
            group = getattr(pgs, name)
            if rank not in members:
                assert group is None, (role, name)
            else:
                assert dist.get_process_group_ranks(group) == members[rank], (role, name)
            checked += 1
        assert dist.get_process_group_ranks(groups.world(role)) == list(model.ranks)
        coords = model.coords(rank)
        assert (dist.get_rank(pgs.tp), dist.get_rank(pgs.pp), dist.get_rank(pgs.dp)) == (
            coords.tp, coords.pp, coords.dp)
        assert (pgs.tp.size(), pgs.pp.size(), pgs.dp.size()) == (model.tp, model.pp, model.dp)
        assert pgs.inter_dist_opt is None
        checked += 1
    return checked
