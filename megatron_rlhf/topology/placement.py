"""Turn a placement request into a plan: contiguous, node-aware blocks of global ranks per model.

    plan = plan_placement(ClusterSpec.homogeneous(16, 8), PlacementConfig("separation", tp=8),
                          "llama-65b")

The cluster is cut into regions: the whole cluster for flattening, interleaving and custom
ratios; a training and an inference region for separation (split by ``train_fraction``) and
hetero-separation (one pool each). Inside a region, models are packed in role order by a cursor:

- a model whose ratio is worth at least one node gets ``floor(ratio * nodes)`` whole nodes;
- a smaller model gets a block inside one node, ``floor(ratio * devices)`` rounded down to a
  divisor of the node size, at an offset that is a multiple of the block size;
- a block starts where the previous one ended and wraps to the region's start when it does not
  fit before the end.

So ``[1, 1, 0.5, 0.5]`` puts actor and critic on everything and ref and reward on the two halves,
``[0.5] * 4`` puts actor and critic on different halves too. Rounding is downwards so halves stay
disjoint on odd node counts. The result is validated by ``validate_plan`` before it is returned.
Pure Python, no torch.distributed: every rank computes the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    ROLES,
    SHADOW_ACTOR,
    SHADOW_CRITIC,
    SHADOW_OF,
    TRAINABLE_ROLES,
    ArchSpec,
    ModelSpec,
    arch_preset,
)
from megatron_rlhf.topology.placement_config import CUSTOM, SEPARATION, PlacementConfig
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan
from megatron_rlhf.topology.validate import validate_plan

logger = get_logger(__name__)

_EPS = 1e-9
"""Slack for ratios such as 0.3 * 10 = 2.9999999999999996 before rounding down."""

ArchLike = str | ArchSpec


@dataclass(frozen=True)
class _Segment:
    """A node, or the part of one node that a region owns."""

    first_rank: int
    size: int
    pool_index: int


@dataclass(frozen=True)
class _Region:
    name: str
    segments: tuple[_Segment, ...]
    ratios: dict[str, float]
    preset: str = ""
    """The strategy whose preset gave ``ratios``; empty when the user gave them or for the
    regions of separation."""

    @property
    def devices(self) -> int:
        return sum(segment.size for segment in self.segments)


def plan_placement(cluster: ClusterSpec, config: PlacementConfig,
                   models: ArchLike | Mapping[str, ArchLike],
                   adapters: Mapping[str, int] | None = None) -> PlacementPlan:
    """Plan where every model lives. Deterministic, pure Python, no torch.distributed.

    Args:
        cluster: the devices.
        config: strategy or ratios, separation split, parallelism.
        models: one architecture (preset name or ``ArchSpec``) for every model, or one per role
            among actor, critic, ref and reward (critic may be left out under AC-Share and
            without a critic, ``config.critic=False``; reward without a reward model,
            ``config.reward=False``). Shadows take the architecture of the model they copy.
        adapters: the elements of the LoRA adapters of each trained role that takes them
            (``LoRAConfig.role_adapters``; ``ModelSpec.adapter_params``), which its shadow
            carries too; None: no adapters.

    Returns:
        The validated plan.

    Raises:
        ValueError: the request cannot work; the message names the field and a fix.
    """
    specs = resolve_models(config, models, adapters)
    placements: dict[str, ModelPlacement] = {}
    for region in _regions(cluster, config, list(specs)):
        placements.update(_pack(region, specs))
    plan = PlacementPlan(cluster, config, {role: placements[role] for role in ROLES
                                           if role in placements})
    validate_plan(plan)
    _warn_if_crowded(plan)
    logger.debug("placement %s: %s", config.strategy,
                 {role: (m.rank_offset, m.size, m.tp, m.pp, m.dp) for role, m in
                  plan.models.items()})
    return plan


def _warn_if_crowded(plan: PlacementPlan) -> None:
    """Warn when models sharing a device cannot all stay resident: each alone fits (validated)."""
    for rank in range(plan.world_size):
        memory = plan.cluster.pools[plan.cluster.locate(rank).pool_index].memory_gib
        if plan.gib_on(rank) > memory:
            logger.warning(
                "rank %d holds %s needing ~%.1f GiB together, more than its %g GiB: they must be "
                "offloaded between stages", rank, ", ".join(plan.roles_on(rank)),
                plan.gib_on(rank), memory,
            )
            return


def resolve_models(config: PlacementConfig, models: ArchLike | Mapping[str, ArchLike],
                   adapters: Mapping[str, int] | None = None) -> dict[str, ModelSpec]:
    """Build the ``ModelSpec`` of every role the strategy places.

    Parallelism is ``config.role_parallel(role)``. Actor and critic are trainable; a shadow
    carries the adapters (``adapters``, by trained role) of the model it copies.

    Raises:
        ValueError: a needed architecture is missing, or a spec is invalid (e.g. heads not
            divisible by tp).
    """
    archs = _archs(config, models)
    roles = list(config.base_roles)
    if config.separated:
        roles += [SHADOW_ACTOR, SHADOW_CRITIC] if config.places_critic else [SHADOW_ACTOR]
    specs = {}
    for role in roles:
        parallel = config.role_parallel(role)
        specs[role] = ModelSpec(role, archs[SHADOW_OF.get(role, role)],
                                trainable=role in TRAINABLE_ROLES, tp=parallel.tp, pp=parallel.pp,
                                distributed_optimizer=parallel.distributed_optimizer,
                                ep=parallel.ep,
                                adapter_params=(adapters or {}).get(SHADOW_OF.get(role, role), 0))
    return specs


def _archs(config: PlacementConfig, models: ArchLike | Mapping[str, ArchLike]
           ) -> dict[str, ArchSpec]:
    if isinstance(models, str | ArchSpec):
        models = {role: models for role in (ACTOR, CRITIC, REF, REWARD)}
    needed = config.base_roles
    missing = [role for role in needed if role not in models]
    if missing:
        hint = " (or set placement.ac_share=True to drop the critic)" if config.places_critic else ""
        raise ValueError(f"models lacks an architecture for {missing}: add them{hint}")
    unknown = sorted(set(models) - {ACTOR, CRITIC, REF, REWARD})
    if unknown:
        raise ValueError(
            f"models has unknown roles {unknown}: give actor, critic, ref and reward; shadows "
            "copy the actor's and critic's architecture"
        )
    return {role: arch_preset(arch) for role, arch in models.items()}


def _regions(cluster: ClusterSpec, config: PlacementConfig, roles: list[str]) -> list[_Region]:
    """Cut the cluster into the strategy's regions, each with the ratio of its roles."""
    nodes = [_Segment(node.first_rank, node.size, node.pool_index) for node in cluster.nodes()]
    if not config.separated:
        ratios = config.role_ratios()
        preset = "" if config.strategy == CUSTOM else config.strategy
        return [_Region("cluster", tuple(nodes), {role: ratios[role] for role in roles}, preset)]
    if config.strategy == SEPARATION:
        train, infer = _split(nodes, config.train_fraction)
    else:
        train_pool, infer_pool = _hetero_pools(cluster, config)
        train = [node for node in nodes if node.pool_index == train_pool]
        infer = [node for node in nodes if node.pool_index == infer_pool]
    return [
        _Region("train", tuple(train),
                {role: 1.0 for role in roles if role in TRAINABLE_ROLES}),
        _Region("inference", tuple(infer),
                {role: 1.0 for role in roles if role not in TRAINABLE_ROLES}),
    ]


def _split(nodes: list[_Segment], train_fraction: float) -> tuple[list[_Segment], list[_Segment]]:
    """Split whole nodes between training and inference, or one node's devices if only one."""
    if len(nodes) >= 2:
        count = min(max(math.floor(train_fraction * len(nodes) + _EPS), 1), len(nodes) - 1)
        return nodes[:count], nodes[count:]
    node = nodes[0]
    if node.size < 2:
        raise ValueError(
            "placement.strategy='separation' needs at least 2 devices (one to train, one for "
            "inference) but the cluster has 1: use strategy='flattening'"
        )
    count = min(max(math.floor(train_fraction * node.size + _EPS), 1), node.size - 1)
    return ([_Segment(node.first_rank, count, node.pool_index)],
            [_Segment(node.first_rank + count, node.size - count, node.pool_index)])


def _hetero_pools(cluster: ClusterSpec, config: PlacementConfig) -> tuple[int, int]:
    """(training pool, inference pool) indices for hetero-separation."""
    pools = cluster.pools
    if len(pools) < 2:
        raise ValueError(
            f"placement.strategy='hetero-separation' needs a cluster of at least 2 pools, this "
            f"one has only {pools[0].kind!r}: add a pool or use strategy='separation'"
        )
    if config.inference_pool is not None:
        infer = cluster.pool_index(config.inference_pool)
    else:
        infer = max(range(len(pools)), key=lambda i: (-pools[i].relative_speed, i))
    if config.train_pool is not None:
        train = cluster.pool_index(config.train_pool)
    else:
        train = max((i for i in range(len(pools)) if i != infer),
                    key=lambda i: (pools[i].relative_speed, -i))
    if train == infer:
        raise ValueError(
            f"placement.train_pool and inference_pool are both {pools[train].kind!r}: "
            "name two different pools"
        )
    idle = [pool.kind for i, pool in enumerate(pools) if i not in (train, infer)]
    if idle:
        logger.warning("hetero-separation leaves pools %s without a model", idle)
    return train, infer


def _pack(region: _Region, specs: Mapping[str, ModelSpec]) -> dict[str, ModelPlacement]:
    """Place the region's models in role order with a wrapping cursor."""
    placements = {}
    cursor = _Cursor(0, 0)
    for role in ROLES:
        if role not in region.ratios:
            continue
        ratio = region.ratios[role]
        if ratio * len(region.segments) + _EPS >= 1:
            blocks, cursor = _whole_nodes(region, ratio, cursor)
        else:
            blocks, cursor = _inside_node(region, role, ratio, cursor)
        placements[role] = ModelPlacement(
            specs[role], blocks[0].first_rank, sum(block.size for block in blocks), ratio
        )
    return placements


def _zero_devices_message(region: _Region, role: str, ratio: float) -> str:
    """Why ``role`` gets no device, in the terms the user chose: a strategy or its ratios."""
    if region.preset:
        return (f"placement.strategy={region.preset!r} places {role} on {ratio:g} of the "
                f"devices, which rounds to zero on this cluster's {region.devices}: "
                f"{region.preset} needs at least {math.ceil(1 / ratio - _EPS)} devices; add "
                "ranks or use placement.strategy='flattening'")
    return (f"placement.ratios gives {role} ratio {ratio} of the {region.devices} devices of "
            f"region {region.name!r}, which rounds to zero devices: raise the ratio to at least "
            f"{1 / region.devices:.3g}")


@dataclass(frozen=True)
class _Cursor:
    """Where the next block may start: a segment index and a device offset inside it."""

    segment: int
    offset: int

    def normalised(self, region: _Region) -> _Cursor:
        """Step over a full segment, and wrap at the region's end."""
        segment, offset = self.segment, self.offset
        if segment < len(region.segments) and offset == region.segments[segment].size:
            segment, offset = segment + 1, 0
        return _Cursor(0, 0) if segment >= len(region.segments) else _Cursor(segment, offset)


def _whole_nodes(region: _Region, ratio: float, cursor: _Cursor
                 ) -> tuple[list[_Segment], _Cursor]:
    """``floor(ratio * nodes)`` whole segments from the next segment boundary (or the start)."""
    total = len(region.segments)
    count = math.floor(ratio * total + _EPS)
    first = cursor.segment + (1 if cursor.offset else 0)
    if first + count > total:
        first = 0
    blocks = list(region.segments[first:first + count])
    return blocks, _Cursor(first + count, 0).normalised(region)


def _inside_node(region: _Region, role: str, ratio: float, cursor: _Cursor
                 ) -> tuple[list[_Segment], _Cursor]:
    """An aligned block inside one segment, sized a divisor of the segment."""
    target = math.floor(ratio * region.devices + _EPS)
    if target < 1:
        raise ValueError(_zero_devices_message(region, role, ratio))
    segment, offset = cursor.segment, cursor.offset
    # Terminates: after wrapping to (0, 0) the block fits, as its size divides the segment.
    while True:
        if segment >= len(region.segments):
            segment, offset = 0, 0
        host = region.segments[segment]
        size = max(d for d in range(1, min(target, host.size) + 1) if host.size % d == 0)
        offset = math.ceil(offset / size) * size
        if offset + size <= host.size:
            block = _Segment(host.first_rank + offset, size, host.pool_index)
            return [block], _Cursor(segment, offset + size).normalised(region)
        segment, offset = segment + 1, 0
