"""Refuse a plan that cannot work, before any process group exists.

``validate_plan`` checks what the planner guarantees by construction and what it cannot know in
advance, so it also guards plans built another way (an automatic planner, a plan read back):

- the roles match the strategy (no critic under AC-Share, no reward or reference model
  without one, shadows exactly under separation);
- every model lies inside the cluster, on whole nodes or a block inside one node;
- TP divides the node size of every pool the model touches (with the previous rule, no TP group
  crosses a node);
- the model's devices are a multiple of ``tp * pp`` (so DP is a whole number), and its
  expert-parallel size divides DP;
- pairs the strategy runs side by side are on disjoint devices;
- the rough memory of each model fits the devices of its pools.
"""

from __future__ import annotations

from megatron_rlhf.topology.cluster import NodeInfo
from megatron_rlhf.topology.models import (
    SHADOW_ACTOR,
    SHADOW_CRITIC,
    TRAINABLE_ROLES,
    divisors_text,
)
from megatron_rlhf.topology.placement_config import CUSTOM, DISJOINT_ROLES, SEPARATED
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan


def validate_plan(plan: PlacementPlan) -> None:
    """Check every placement rule.

    Raises:
        ValueError: the first broken rule, naming the model, the numbers and a fix.
    """
    _check_roles(plan)
    nodes = plan.cluster.nodes()
    node_of = [node for node in nodes for _ in node.ranks]
    for model in plan.models.values():
        _check_bounds(plan, model)
        _check_node_aware(model, node_of)
        _check_parallel_fits(plan, model)
        _check_memory(plan, model)
    _check_disjoint(plan)


def _check_roles(plan: PlacementPlan) -> None:
    config = plan.config
    expected = set(config.base_roles)
    if config.separated:
        expected |= {SHADOW_ACTOR, SHADOW_CRITIC} if config.places_critic else {SHADOW_ACTOR}
    if set(plan.models) != expected:
        raise ValueError(
            f"plan places {sorted(plan.models)} but strategy={config.strategy!r} with "
            f"ac_share={config.ac_share} places {sorted(expected)} (critic={config.critic}, "
            f"reward={config.reward}, reference={config.reference}): plan it with plan_placement"
        )


def _check_bounds(plan: PlacementPlan, model: ModelPlacement) -> None:
    world = plan.world_size
    if model.tp * model.pp > world:
        raise ValueError(
            f"{model.role} needs tp*pp = {model.tp}*{model.pp} = {model.tp * model.pp} devices "
            f"but the cluster has {world}: lower {model.role}.tp or {model.role}.pp"
        )
    if model.size < 1 or model.rank_offset < 0 or model.ranks.stop > world:
        raise ValueError(
            f"{model.role} ranks [{model.rank_offset}, {model.ranks.stop}) ask for devices "
            f"outside the cluster's [0, {world}): give it at most {world} devices"
        )


def _check_node_aware(model: ModelPlacement, node_of: list[NodeInfo]) -> None:
    first, last = node_of[model.ranks.start], node_of[model.ranks.stop - 1]
    whole_nodes = model.ranks.start == first.first_rank and model.ranks.stop == last.ranks.stop
    if first.index != last.index and not whole_nodes:
        raise ValueError(
            f"{model.role} ranks [{model.ranks.start}, {model.ranks.stop}) straddle nodes "
            f"{first.index}..{last.index}: a model takes whole nodes or a block inside one node"
        )


def _check_parallel_fits(plan: PlacementPlan, model: ModelPlacement) -> None:
    """TP divides every node the model touches; with node-aware blocks no TP group crosses."""
    role, tp, pp = model.role, model.tp, model.pp
    for pool_index in plan.pools_of(model.role):
        pool = plan.cluster.pools[pool_index]
        if pool.devices_per_node % tp:
            raise ValueError(
                f"{role}.tp({tp}) does not divide devices_per_node({pool.devices_per_node}) of "
                f"pool {pool.kind!r}: choose tp in {divisors_text(pool.devices_per_node)}"
            )
    if model.size % (tp * pp):
        strategy = plan.config.strategy
        ratio, other = ((f"placement.ratios gives {model.ratio}", "change its ratio")
                        if strategy == CUSTOM else
                        (f"ratio {model.ratio} of placement.strategy={strategy!r}",
                         "choose another placement.strategy"))
        raise ValueError(
            f"{role} is placed on {model.size} device{'s' * (model.size != 1)} ({ratio}), not "
            f"a multiple of tp*pp = {tp}*{pp} = {tp * pp}: choose {role} tp*pp in "
            f"{divisors_text(model.size)} (placement.parallel[{role!r}]) or {other}"
        )
    ep, dp = model.spec.ep, model.dp
    if dp % ep:
        raise ValueError(
            f"placement.parallel.{role}.ep({ep}) does not divide {role}'s data-parallel size "
            f"dp({dp}) ({model.size} devices / tp*pp {tp * pp}): choose ep in "
            f"{divisors_text(dp)} or give {role} more devices"
        )


def _check_memory(plan: PlacementPlan, model: ModelPlacement) -> None:
    """Refuse a model whose states cannot fit its devices even fully sharded over DP (FSDP for
    trainable models) or, under the distributed optimizer, with the optimizer on the host (the
    planner decides whether a lighter option suffices)."""
    spec = model.spec
    need = spec.gib_per_device(model.dp, fully_sharded=True)
    host_optimizer = spec.trainable and spec.distributed_optimizer and not spec.adapter_params
    if host_optimizer:
        need = min(need, spec.gib_with_host_optimizer())
    for pool_index in plan.pools_of(model.role):
        pool = plan.cluster.pools[pool_index]
        if need <= pool.memory_gib:
            continue
        states = ("weights, grads and Adam state, fully sharded over dp" if spec.trainable
                  else "weights")
        if host_optimizer:
            states += ", or weights and grads with the optimizer on the host"
        # A trainable model needs 18 N / devices bytes fully sharded, 6 N / (tp pp) with its
        # optimizer on the host: only more devices help.
        fix = ("give it more devices" if spec.trainable
               else f"raise {model.role}.tp or {model.role}.pp")
        raise ValueError(
            f"{model.role} needs ~{need:.1f} GiB per device ({states} of "
            f"{spec.num_params() / 1e9:.2f}B params over tp*pp = {model.tp * model.pp}, "
            f"dp = {model.dp}) but pool {pool.kind!r} has {pool.memory_gib:g} GiB: "
            f"{fix}"
        )


def _check_disjoint(plan: PlacementPlan) -> None:
    pairs = list(DISJOINT_ROLES.get(plan.config.strategy, ()))
    if plan.config.strategy in SEPARATED:
        pairs += [(train, infer) for train in TRAINABLE_ROLES for infer in plan.models
                  if infer not in TRAINABLE_ROLES]
    for left, right in pairs:
        if left not in plan.models or right not in plan.models:
            continue
        a, b = plan.models[left], plan.models[right]
        if a.overlaps(b):
            raise ValueError(
                f"placement {plan.config.strategy!r} runs {left} and {right} side by side, but "
                f"{left} ranks [{a.ranks.start}, {a.ranks.stop}) and {right} ranks "
                f"[{b.ranks.start}, {b.ranks.stop}) overlap: give them ratios that sum to at "
                "most 1, or use strategy='custom' to let them share devices"
            )
