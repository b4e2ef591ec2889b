"""Build a plan's process groups with torch.distributed and hand each model its collection.

    groups = build_process_groups(plan, timeout=datetime.timedelta(minutes=10))
    pg_collection = groups["actor"]          # None if this rank holds no part of the actor
    model = GPTModel(..., pg_collection=pg_collection)

Every rank must call ``build_process_groups`` with the same plan, in the same order relative to
other group creation: ``torch.distributed.new_group`` is collective over the default group. Each
model's sub-grid is Megatron's ``HyperCommGrid([tp, 1, dp, pp], ["tp", "cp", "dp", "pp"],
rank_offset)``; a mixture-of-experts model with ``ep > 1`` also gets megatron's expert groups
(``ep``, ``expt_dp``, ``tp_ep``, ``tp_ep_pp``: ``topology.experts``). No model relies on
Megatron's global parallel state.

Groups with identical membership are created once and shared, within a model (with cp = 1 the
``dp_cp`` group is the ``dp`` group) and across models (under flattening, actor and critic with
the same tp/pp share every group; every size-1 group of a rank is one group). Fewer groups means
fewer communicators, and sharing is safe because a process runs its models one after another.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.runtime.distributed import supports_split_group
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.experts import expert_rank_enums
from megatron_rlhf.topology.grid import DIM_NAMES
from megatron_rlhf.topology.models import ModelSpec
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan

logger = get_logger(__name__)

_GRID_GROUPS = {
    "tp": ["tp"],
    "pp": ["pp"],
    "dp": ["dp"],
    "cp": ["cp"],
    "mp": ["tp", "pp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
    "world": list(DIM_NAMES),
}
"""Groups read off each model's HyperCommGrid: collection field -> grid dimensions."""


class RankProcessGroups(Mapping[str, ProcessGroupCollection | None]):
    """This rank's groups: role -> ``ProcessGroupCollection``, None where it holds no part.

    Besides the mapping, ``world(role)`` is the group of all of a model's ranks (for
    broadcasting inside a model), None where this rank holds no part of it.
    """

    def __init__(self, plan: PlacementPlan, collections: dict[str, ProcessGroupCollection | None],
                 worlds: dict[str, dist.ProcessGroup | None]) -> None:
        self.plan = plan
        self._collections = collections
        self._worlds = worlds

    def __getitem__(self, role: str) -> ProcessGroupCollection | None:
        return self._collections[role]

    def __iter__(self) -> Iterator[str]:
        return iter(self._collections)

    def __len__(self) -> int:
        return len(self._collections)

    @property
    def local_roles(self) -> tuple[str, ...]:
        """Roles this rank holds a part of."""
        return tuple(role for role, pgs in self._collections.items() if pgs is not None)

    def world(self, role: str) -> dist.ProcessGroup | None:
        """The group of every rank of ``role``, or None if this rank is not one of them."""
        return self._worlds[role]


def build_process_groups(plan: PlacementPlan,
                         timeout: datetime.timedelta | float | None = None) -> RankProcessGroups:
    """Create every group of every model; collective over the default process group.

    Args:
        plan: the placement, identical on every rank.
        timeout: timeout of collectives on the new groups (a timedelta or seconds); None keeps
            the default group's.

    Returns:
        This rank's groups for each placed role.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the plan covers a different number of ranks than the default group.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed initialised first")
    world_size = dist.get_world_size()
    if plan.world_size != world_size:
        raise ValueError(
            f"the plan covers {plan.world_size} ranks but the default process group has "
            f"{world_size}: plan for the launched cluster (nodes x devices_per_node = world)"
        )
    if isinstance(timeout, int | float):
        timeout = datetime.timedelta(seconds=timeout)
    factory = _GroupFactory(dist.get_rank(), timeout)
    collections: dict[str, ProcessGroupCollection | None] = {}
    worlds: dict[str, dist.ProcessGroup | None] = {}
    for role in plan.roles:
        collections[role], worlds[role] = _model_groups(plan[role], factory)
    logger.info("built %d process groups for %s in %d creation calls (%s)", factory.count,
                ", ".join(plan.roles), factory.calls,
                "split_group per grid dimension" if factory.split else "new_group each")
    return RankProcessGroups(plan, collections, worlds)


def build_model_process_groups(spec: ModelSpec,
                               timeout: datetime.timedelta | float | None = None
                               ) -> ProcessGroupCollection:
    """Groups of one model spread over every rank (DP = world / (tp * pp)).

    For jobs that train or convert a single model (SFT, reward-model training, checkpoint
    conversion). Collective over the default group.

    Raises:
        ValueError: ``tp * pp`` does not divide the world size.
    """
    world = dist.get_world_size()
    if world % spec.model_parallel_size:
        raise ValueError(f"{spec.role}: tp({spec.tp}) * pp({spec.pp}) must divide the number of "
                         f"ranks ({world}); launch with a multiple of {spec.model_parallel_size}")
    if isinstance(timeout, int | float):
        timeout = datetime.timedelta(seconds=timeout)
    collection, _ = _model_groups(ModelPlacement(spec, 0, world, 1.0),
                                  _GroupFactory(dist.get_rank(), timeout))
    return collection


class _GroupFactory:
    """Creates each distinct membership once, in call order, and remembers this rank's.

    Under NCCL with a bound device every group creation is a communicator split that the whole
    world blocks in, so an enumeration's new memberships (disjoint: one per replica of a grid
    dimension) are created by one ``split_group`` call where the backend can split; otherwise
    one ``new_group`` each. ``calls`` counts the creations either way.
    """

    def __init__(self, rank: int, timeout: datetime.timedelta | None,
                 split: bool | None = None) -> None:
        self.rank = rank
        self.timeout = timeout
        self.split = supports_split_group() if split is None else split
        self.calls = 0
        self._created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    @property
    def count(self) -> int:
        return len(self._created)

    def mine(self, enumeration: list[list[int]], desc: str) -> dist.ProcessGroup | None:
        """Create the enumerated groups not created yet; return the one holding this rank."""
        keys = [tuple(sorted(ranks)) for ranks in enumeration]
        new = list(dict.fromkeys(key for key in keys if key not in self._created))
        disjoint = len({rank for key in new for rank in key}) == sum(map(len, new))
        if self.split and disjoint and new:
            group = dist.split_group(split_ranks=[list(key) for key in new],
                                     timeout=self.timeout, group_desc=desc)
            self.calls += 1
            self._created.update({key: group if self.rank in key else None for key in new})
        for key in new if not (self.split and disjoint) else ():
            group = dist.new_group(list(key), timeout=self.timeout, group_desc=desc)
            self.calls += 1
            self._created[key] = group if self.rank in key else None
        return next((self._created[key] for key in keys if self.rank in key), None)


def _model_groups(model: ModelPlacement, factory: _GroupFactory
                  ) -> tuple[ProcessGroupCollection | None, dist.ProcessGroup | None]:
    """Create one model's groups (every rank) and this rank's collection (its ranks only)."""
    grid = HyperCommGrid(list(model.shape), list(DIM_NAMES), rank_offset=model.rank_offset)
    pg = {
        name: factory.mine(grid.get_rank_enum(dims), f"{model.role}_{name}")
        for name, dims in _GRID_GROUPS.items()
    }
    pg["embd"] = factory.mine(model.embedding_ranks(), f"{model.role}_embd")
    pg["pos_embd"] = factory.mine(model.position_embedding_ranks(), f"{model.role}_pos_embd")
    alone = pg["cp"]  # cp = 1: the group of this rank alone
    # A dense model (or ep = 1) is a single expert: expert parallelism of size 1 over the dense
    # layout. With ep > 1 the experts follow megatron's expert grid (``topology.experts``).
    expert = {"ep": alone, "tp_ep": pg["tp"], "tp_ep_pp": pg["mp"], "expt_dp": pg["dp"]}
    if model.spec.ep > 1:
        enums = expert_rank_enums(model.rank_offset, model.tp, model.dp, model.pp, model.spec.ep)
        expert = {name: factory.mine(enums[name], f"{model.role}_{name}") for name in expert}
    if not model.holds(factory.rank):
        return None, None
    collection = ProcessGroupCollection(
        tp=pg["tp"], pp=pg["pp"], mp=pg["mp"], cp=alone, tp_cp=pg["tp"],
        embd=pg["embd"], pos_embd=pg["pos_embd"],
        dp=pg["dp"], dp_cp=pg["dp"], intra_dp_cp=pg["dp"], tp_dp_cp=pg["tp_dp_cp"],
        ep=expert["ep"], expt_tp=pg["tp"], tp_ep=expert["tp_ep"], tp_ep_pp=expert["tp_ep_pp"],
        expt_dp=expert["expt_dp"], intra_expt_dp=expert["expt_dp"],
        # One distributed-optimizer instance spanning the whole model.
        inter_dist_opt=None, intra_dist_opt=pg["world"],
    )
    return collection, pg["world"]
