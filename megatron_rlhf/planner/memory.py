"""Memory of a PPO step on every device of a plan: what stays resident, what must be offloaded,
how many sequences a generation round can hold, and what cannot fit at all.

The device memory of a rank holds the states of every model placed on it (``state_bytes``) plus
the working memory of the one stage running (activations, or the KV cache while generating).
When the resident states and the largest working set exceed the usable memory, the models of
that rank are swapped to the host between stages (the engine's offloading): each model is then
alone with its working set, and its stages pay ``offload_seconds``. A model that does not fit
even alone makes the plan infeasible, with the fix in the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.hardware import HardwareProfile
from megatron_rlhf.planner.workload import RolloutSpec
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    SHADOW_ACTOR,
    SHADOW_CRITIC,
    TRAINABLE_ROLES,
    VALUE_HEAD_ROLES,
)
from megatron_rlhf.topology.placement_config import HETERO_SEPARATION
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan

_GIB = 1024**3


def generating_roles(plan: PlacementPlan) -> tuple[str, ...]:
    """Models whose replicas generate: the shadow actor if placed, else the actor; under
    hetero-separation also the trainable actor when it has no pipeline (as the engine does)."""
    if SHADOW_ACTOR not in plan.models:
        return (ACTOR,)
    if plan.config.strategy == HETERO_SEPARATION and plan[ACTOR].pp == 1:
        return (SHADOW_ACTOR, ACTOR)
    return (SHADOW_ACTOR,)


def experience_roles(plan: PlacementPlan) -> tuple[str, ...]:
    """Models that run an experience forward pass: policy (old log-probs), value model, ref,
    reward. Under AC-Share the policy's forward also gives the values."""
    policy = SHADOW_ACTOR if SHADOW_ACTOR in plan.models else ACTOR
    value = SHADOW_CRITIC if SHADOW_CRITIC in plan.models else CRITIC
    return tuple(role for role in (policy, value, REF, REWARD) if role in plan.models)


def pool_of_replicas(plan: PlacementPlan, role: str) -> dict[int, int]:
    """Pool index -> number of the model's DP replicas whose first rank lies in that pool."""
    model = plan[role]
    counts: dict[int, int] = {}
    for dp in range(model.dp):
        pool = plan.cluster.locate(model.global_rank(0, dp, 0)).pool_index
        counts[pool] = counts.get(pool, 0) + 1
    return counts


def generation_rows(plan: PlacementPlan, batch: int) -> dict[str, dict[int, int]]:
    """Rows one generating replica gets, per role and pool: shares in proportion to the pool's
    ``relative_speed`` (the engine's ``generation_layout``), rounded up."""
    replicas = {role: pool_of_replicas(plan, role) for role in generating_roles(plan)}
    speed = {role: {pool: plan.cluster.pools[pool].relative_speed for pool in pools}
             for role, pools in replicas.items()}
    total = sum(count * speed[role][pool] for role, pools in replicas.items()
                for pool, count in pools.items())
    return {role: {pool: math.ceil(batch * speed[role][pool] / total) for pool in pools}
            for role, pools in replicas.items()}


@dataclass(frozen=True)
class RoleMemory:
    """Memory of one model on one of its devices, GiB.

    Attributes:
        weights: bf16 weights.
        grads: bf16 gradients.
        optimizer: fp32 master weights and Adam moments.
        activations: the largest activation working set (training or forward pass).
        kv_cache: KV cache of one generation round (generating models).
        offloaded: its devices cannot hold everything placed there, so it is swapped to the host
            between stages.
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    offloaded: bool

    @property
    def total(self) -> float:
        """Everything this model needs while its largest stage runs."""
        return self.weights + self.grads + self.optimizer + max(self.activations, self.kv_cache)


@dataclass
class MemoryReport:
    """The memory side of a prediction.

    Attributes:
        roles: per model, its memory on one device.
        sequences_per_round: per generating model, the most sequences one replica holds in a
            round (the KV-cache bound).
        offloaded: models that are swapped to the host between stages.
        peak_gib: the most memory any device uses.
        usable_gib: the usable memory of that device.
        largest_batch: the largest rollout batch generated in one round on every replica.
        largest_micro_batch: per trainable model, the largest micro-batch its training fits.
        problems: why the plan cannot run (empty when it can), each with a fix.
    """

    roles: dict[str, RoleMemory] = field(default_factory=dict)
    sequences_per_round: dict[str, int] = field(default_factory=dict)
    offloaded: set[str] = field(default_factory=set)
    peak_gib: float = 0.0
    usable_gib: float = 0.0
    largest_batch: int = 0
    largest_micro_batch: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Needs:
    """Bytes one model needs on one device: its states and its working sets."""

    state: cm.StateBytes
    activations: float
    train_per_row: float
    kv_per_sequence: float


def _needs(model: ModelPlacement, rollout: RolloutSpec, forward: bool,
           generates: bool) -> _Needs:
    arch, tp, pp = model.spec.arch, model.tp, model.pp
    seq, mbs = rollout.sequence_length, rollout.micro_batch_size
    value_head = model.role in VALUE_HEAD_ROLES
    state = cm.state_bytes(model.spec.num_params(), tp, pp, model.dp, model.spec.trainable,
                           model.spec.distributed_optimizer)
    activations, per_row = 0.0, 0.0
    if forward:
        activations = cm.forward_activation_bytes(arch, seq, mbs, tp, value_head)
    if model.role in TRAINABLE_ROLES:
        rows = math.ceil(rollout.batch / rollout.num_minibatches / model.dp)
        microbatches = math.ceil(rows / mbs)
        train = [cm.training_activation_bytes(arch, seq, size, tp, pp, microbatches,
                                              rollout.activation_checkpointing, value_head)
                 for size in (1, mbs)]
        activations, per_row = max(activations, train[1]), train[0]
    kv = 0.0
    if generates:
        kv = (cm.kv_cache_bytes(arch, tp, pp, 1, seq)
              + cm.logits_bytes(arch, 1, tp, training=False))
    return _Needs(state, activations, per_row, kv)


def _atoms(plan: PlacementPlan) -> list[tuple[range, int, tuple[str, ...]]]:
    """Blocks of consecutive ranks with the same pool and the same models."""
    cuts = {0, plan.world_size}
    for model in plan.models.values():
        cuts |= {model.ranks.start, model.ranks.stop}
    for node in plan.cluster.nodes():
        cuts.add(node.first_rank)
    bounds = sorted(cuts)
    return [(range(a, b), plan.cluster.locate(a).pool_index, plan.roles_on(a))
            for a, b in zip(bounds, bounds[1:], strict=False) if plan.roles_on(a)]


def plan_memory(plan: PlacementPlan, rollout: RolloutSpec,
                profiles: tuple[HardwareProfile, ...]) -> MemoryReport:
    """Check every device of the plan and size the generation rounds.

    Args:
        plan: the placement.
        rollout: the step's shapes.
        profiles: the profile of every pool, in pool order.
    """
    gen, fwd = generating_roles(plan), experience_roles(plan)
    needs = {role: _needs(plan[role], rollout, role in fwd, role in gen) for role in plan.roles}
    report = MemoryReport()
    capacity = {role: math.inf for role in gen}
    for ranks, pool, roles in _atoms(plan):
        usable = profiles[pool].usable_bytes
        report.usable_gib = max(report.usable_gib, usable / _GIB)
        resident = sum(needs[role].state.total for role in roles)
        largest = max(max(needs[r].activations, needs[r].kv_per_sequence) for r in roles)
        swap = resident + largest > usable
        if swap:
            report.offloaded |= set(roles)
        for role in roles:
            free = usable - (needs[role].state.total if swap else resident)
            _check_role(report, role, needs[role], free, ranks, rollout)
            if role in gen and needs[role].kv_per_sequence:
                capacity[role] = min(capacity[role], free // needs[role].kv_per_sequence)
    report.sequences_per_round = {role: int(capacity[role]) for role in gen}
    if not report.problems:
        _finish(report, plan, rollout, needs)
    return report


def _check_role(report: MemoryReport, role: str, need: _Needs, free: float, ranks: range,
                rollout: RolloutSpec) -> None:
    """Record what does not fit for ``role`` on ``ranks`` with ``free`` bytes left for it."""
    where = f"{role} on ranks [{ranks.start}, {ranks.stop})"
    if free <= 0:
        report.problems.append(
            f"{where}: its states alone need {need.state.total / _GIB:.1f} GiB, more than the "
            f"device holds: raise {role}.tp or {role}.pp, or give it more devices (dp) with the "
            "distributed optimizer")
        return
    if need.train_per_row:
        fits = int(free // need.train_per_row)
        report.largest_micro_batch[role] = min(report.largest_micro_batch.get(role, fits), fits)
    if need.activations > free:
        report.problems.append(
            f"{where}: activations of micro_batch_size={rollout.micro_batch_size} need "
            f"{need.activations / _GIB:.1f} GiB, {free / _GIB:.1f} GiB are left: lower "
            "rollout.micro_batch_size or enable activation checkpointing")
    if need.kv_per_sequence and free < need.kv_per_sequence:
        report.problems.append(
            f"{where}: no room for the KV cache of one sequence "
            f"({need.kv_per_sequence / _GIB:.2f} GiB): raise {role}.tp or shorten the sequences")


def _finish(report: MemoryReport, plan: PlacementPlan, rollout: RolloutSpec,
            needs: dict[str, _Needs]) -> None:
    """Fill the per-role breakdown, the peak device memory and the largest one-round batch."""
    rows = generation_rows(plan, rollout.batch)
    kv_used = {}
    for role, per_pool in rows.items():
        most = max(per_pool.values())
        cap = report.sequences_per_round[role]
        kv_used[role] = math.ceil(most / math.ceil(most / cap)) * needs[role].kv_per_sequence
        report.largest_batch += cap * plan[role].dp
    for role in plan.roles:
        state, need = needs[role].state, needs[role]
        report.roles[role] = RoleMemory(
            state.weights / _GIB, state.grads / _GIB, state.optimizer / _GIB,
            need.activations / _GIB, kv_used.get(role, 0.0) / _GIB, role in report.offloaded)
    for _, _, roles in _atoms(plan):
        work = {r: max(report.roles[r].activations, report.roles[r].kv_cache) for r in roles}
        if set(roles) & report.offloaded:
            peak = max(needs[r].state.total / _GIB + work[r] for r in roles)
        else:
            peak = sum(needs[r].state.total for r in roles) / _GIB + max(work.values())
        report.peak_gib = max(report.peak_gib, peak)
