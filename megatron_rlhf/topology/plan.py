"""The result of planning: which contiguous block of global ranks each model holds, and its grid.

A ``PlacementPlan`` is pure data, identical on every rank. Everything here is rank arithmetic
without torch.distributed: the process groups are built from it by ``build_process_groups``; the
engine uses ``replica_ranks`` and ``leader_ranks`` to scatter batch shards to a model and gather
its outputs (point-to-point on the default group, no per-pair groups needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.grid import GridCoords, grid_coords, grid_rank, grid_rank_enum
from megatron_rlhf.topology.models import ROLES, ModelSpec
from megatron_rlhf.topology.placement_config import PlacementConfig


@dataclass(frozen=True)
class ModelPlacement:
    """One model's devices and grid.

    Attributes:
        spec: the model (role, architecture, tp, pp, optimizer).
        rank_offset: its first global rank.
        size: number of devices; ``dp = size / (tp * pp)``.
        ratio: the requested fraction of its region (``size`` is the node-aware rounding).
    """

    spec: ModelSpec
    rank_offset: int
    size: int
    ratio: float

    @property
    def role(self) -> str:
        """The model's role."""
        return self.spec.role

    @property
    def tp(self) -> int:
        """Tensor-parallel size."""
        return self.spec.tp

    @property
    def pp(self) -> int:
        """Pipeline-parallel size."""
        return self.spec.pp

    @property
    def dp(self) -> int:
        """Data-parallel size, derived from the device count."""
        return self.size // (self.spec.tp * self.spec.pp)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Grid shape over ``("tp", "cp", "dp", "pp")``; context parallelism is 1."""
        return (self.tp, 1, self.dp, self.pp)

    @property
    def ranks(self) -> range:
        """The model's global ranks."""
        return range(self.rank_offset, self.rank_offset + self.size)

    def holds(self, rank: int) -> bool:
        """Whether global ``rank`` holds a part of this model."""
        return self.rank_offset <= rank < self.rank_offset + self.size

    def overlaps(self, other: ModelPlacement) -> bool:
        """Whether the two models share a device."""
        return self.rank_offset < other.ranks.stop and other.rank_offset < self.ranks.stop

    def coords(self, rank: int) -> GridCoords:
        """The (tp, cp, dp, pp) coordinates of global ``rank`` in this model's grid."""
        return grid_coords(self.rank_offset, self.shape, rank)

    def global_rank(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at grid coordinates (tp, dp, pp)."""
        return grid_rank(self.rank_offset, self.shape, GridCoords(tp=tp, cp=0, dp=dp, pp=pp))

    def group_ranks(self, dims: str | list[str]) -> list[list[int]]:
        """Members of every group over ``dims`` (same order as ``HyperCommGrid.get_rank_enum``)."""
        return grid_rank_enum(self.rank_offset, self.shape, dims)

    def embedding_ranks(self) -> list[list[int]]:
        """Megatron's embedding groups: first and last pipeline stage of each pipeline."""
        return [sorted({ranks[0], ranks[-1]}) for ranks in self.group_ranks("pp")]

    def position_embedding_ranks(self) -> list[list[int]]:
        """Megatron's position-embedding groups: the first pipeline stage of each pipeline."""
        return [[ranks[0]] for ranks in self.group_ranks("pp")]

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Every global rank of data-parallel replica ``dp_rank`` (tp x pp ranks), increasing.

        The engine sends replica ``dp_rank`` its shard of the batch.
        """
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"{self.role}: dp_rank {dp_rank} is outside [0, {self.dp})")
        return [self.global_rank(tp, dp_rank, pp) for pp in range(self.pp) for tp in range(self.tp)]

    def leader_ranks(self, stage: str = "first") -> list[int]:
        """Per DP replica, the rank with ``tp_rank == 0`` on the first or last pipeline stage.

        Inputs enter a replica at its first stage and outputs leave at its last, so these are
        the ranks the engine scatters batch shards to and gathers results from, in DP order.

        Args:
            stage: ``"first"`` or ``"last"`` pipeline stage.
        """
        if stage not in ("first", "last"):
            raise ValueError(f"stage={stage!r} must be 'first' or 'last'")
        pp_rank = 0 if stage == "first" else self.pp - 1
        return [self.global_rank(0, dp, pp_rank) for dp in range(self.dp)]

    def to_dict(self) -> dict:
        """JSON-ready description."""
        return {
            **self.spec.to_dict(), "dp": self.dp, "rank_offset": self.rank_offset,
            "size": self.size, "ratio": self.ratio,
            "gib_per_device": round(self.spec.gib_per_device(self.dp), 3),
        }


@dataclass(frozen=True)
class PlacementPlan:
    """Every placed model, keyed by role in ``ROLES`` order. Built by ``plan_placement``.

    Attributes:
        cluster: the cluster planned for.
        config: the request.
        models: role -> placement, only for the roles placed (no critic under AC-Share, shadows
            only under separation).
    """

    cluster: ClusterSpec
    config: PlacementConfig
    models: dict[str, ModelPlacement]

    @property
    def world_size(self) -> int:
        """Ranks the plan covers: the whole cluster."""
        return self.cluster.world_size

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles placed, in ``ROLES`` order."""
        return tuple(role for role in ROLES if role in self.models)

    def __getitem__(self, role: str) -> ModelPlacement:
        if role not in self.models:
            raise KeyError(f"role {role!r} is not placed; placed roles: {self.roles}")
        return self.models[role]

    def roles_on(self, rank: int) -> tuple[str, ...]:
        """Roles that global ``rank`` holds a part of."""
        return tuple(role for role in self.roles if self.models[role].holds(rank))

    def pools_of(self, role: str) -> tuple[int, ...]:
        """Indices of the cluster pools that hold ranks of ``role``."""
        model = self[role]
        first = self.cluster.locate(model.ranks.start).pool_index
        last = self.cluster.locate(model.ranks.stop - 1).pool_index
        return tuple(range(first, last + 1))

    def gib_on(self, rank: int) -> float:
        """Rough memory of every model state on ``rank``, GiB (see ``ModelSpec.bytes_per_device``).

        Models that share a device run one after another; this sum is only reached if none of
        them is offloaded in between.
        """
        return sum(self.models[role].spec.gib_per_device(self.models[role].dp)
                   for role in self.roles_on(rank))

    def to_dict(self) -> dict:
        """JSON-ready description of the cluster, the request and every model."""
        return {
            "world_size": self.world_size,
            "cluster": self.cluster.to_dict(),
            "placement": self.config.to_dict(),
            "models": {role: {**self.models[role].to_dict(),
                              "pools": [self.cluster.pools[i].kind for i in self.pools_of(role)]}
                       for role in self.roles},
        }
