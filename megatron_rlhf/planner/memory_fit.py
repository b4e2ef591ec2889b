"""Memory of a PPO step on every device of a plan: the memory options each model needs, how
many sequences a generation round can hold, and what cannot fit at all.

A device holds the states of every model placed on it that is not offloaded
(``cost_model.state_bytes``) plus, for the one stage running, what that stage brings back from
the host and its working memory: activations of a forward or training micro-batch, the KV cache
of a generation micro-batch, the layers FSDP gathers. Per model, the options are those of the
engine and Megatron (``MemoryOptions``): the distributed optimizer or FSDP, activation
recomputation, offloading to the host between stages, the optimizer on the host. What lives on
the host (offloaded states, host optimizers) must fit each node's host memory. ``fit_memory`` picks, among the
combinations, the cheapest one (by the seconds a caller prices them at) with which every device
fits; a plan is infeasible only when even every option together does not fit, and the problems
then name the fixes left (more devices, smaller micro-batches, shorter sequences).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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
    SHADOW_OF,
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
    reward. Under AC-Share the policy's forward also gives the values; without a reference
    model (LoRA) the trainable actor's base gives the reference log-probs."""
    return tuple(experience_passes(plan))


def experience_passes(plan: PlacementPlan) -> dict[str, int]:
    """The experience forward passes of each model of :func:`experience_roles`: two on an actor
    that is both the policy and, with its adapters off, the reference."""
    policy = SHADOW_ACTOR if SHADOW_ACTOR in plan.models else ACTOR
    value = SHADOW_CRITIC if SHADOW_CRITIC in plan.models else CRITIC
    reference = REF if plan.config.reference else ACTOR
    passes: dict[str, int] = {}
    for role in (policy, value, reference, REWARD):
        if role in plan.models:
            passes[role] = passes.get(role, 0) + 1
    return passes


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


FSDP, RECOMPUTE, OFFLOAD = cm.FULLY_SHARDED, "recompute", "offload"
OPTIMIZER_OFFLOAD = "optimizer_offload"
MEMORY_OPTIONS = (FSDP, RECOMPUTE, OFFLOAD, OPTIMIZER_OFFLOAD)
"""The options the planner may add to a request, as the engine runs them: offloading and
recomputation (``models.offload``, ``models.recompute``), Megatron-FSDP
(``<role>_optimizer.fsdp``) where ``engine_runs_fsdp``, and the optimizer on the host
(``<role>_optimizer.cpu_offload_fraction``) where ``engine_runs_optimizer_offload``
(docs/planner.md, "engine support")."""


@dataclass(frozen=True)
class MemoryOptions:
    """How one model saves device memory, as the engine and Megatron can run it.

    Attributes:
        sharding: one of ``cost_model.SHARDINGS`` (``replicated`` for inference-only models,
            which hold whole bf16 weights).
        recompute: recompute activations in the backward pass (trainable models).
        offload: keep the states on the host between stages (``models.offload.<role>=always``;
            a shadow follows the model it copies).
        optimizer_offload: keep the distributed optimizer's shard on the host and update it
            there (``<role>_optimizer.cpu_offload_fraction=1``).
    """

    sharding: str = cm.REPLICATED
    recompute: bool = False
    offload: bool = False
    optimizer_offload: bool = False

    @property
    def label(self) -> str:
        """``distributed_optimizer``, ``fsdp+recompute+offload``, ... (``replicated`` alone for
        a model with nothing to save)."""
        flags = [name for name in (RECOMPUTE, OFFLOAD, OPTIMIZER_OFFLOAD) if getattr(self, name)]
        return "+".join([self.sharding, *flags])

    def to_dict(self) -> dict:
        """JSON-ready description."""
        return {"sharding": self.sharding, "recompute": self.recompute, "offload": self.offload,
                "optimizer_offload": self.optimizer_offload}


def base_options(model: ModelPlacement, rollout: RolloutSpec) -> MemoryOptions:
    """What the request asks for: the model's own sharding, the rollout's recomputation."""
    if not model.spec.trainable:
        return MemoryOptions()
    sharding = cm.DISTRIBUTED_OPTIMIZER if model.spec.distributed_optimizer else cm.REPLICATED
    return MemoryOptions(sharding, rollout.activation_checkpointing)


def check_memory_options(names: tuple[str, ...]) -> None:
    """Raise ValueError for a name that is not one of ``MEMORY_OPTIONS``."""
    unknown = sorted(set(names) - set(MEMORY_OPTIONS))
    if unknown:
        raise ValueError(f"memory options {unknown} are unknown: use some of {MEMORY_OPTIONS}")


def option_menu(model: ModelPlacement, rollout: RolloutSpec,
                allowed: tuple[str, ...] = MEMORY_OPTIONS, fsdp: bool = True,
                optimizer_offload: bool = False) -> list[MemoryOptions]:
    """Every option combination for ``model``, from its ``base_options`` up, among ``allowed``:
    more sharding (FSDP only where ``fsdp`` says the engine runs it, never offloaded),
    recomputation, offloading, and the distributed optimizer's shard on the host where
    ``optimizer_offload`` says the engine runs it."""
    base = base_options(model, rollout)
    offloads = (False, True) if OFFLOAD in allowed else (False,)
    if not model.spec.trainable:
        return [replace(base, offload=o) for o in offloads]
    shardings = [s for s in cm.SHARDINGS[cm.SHARDINGS.index(base.sharding):]
                 if s != FSDP or (fsdp and FSDP in allowed)]
    more = RECOMPUTE in allowed and not base.recompute
    recomputes = (False, True) if more else (base.recompute,)
    hosts = (False, True) if optimizer_offload and OPTIMIZER_OFFLOAD in allowed else (False,)
    return [MemoryOptions(s, r, o, h) for s in shardings for r in recomputes for o in offloads
            for h in hosts
            if not (s == FSDP and o) and not (h and s != cm.DISTRIBUTED_OPTIMIZER)]


def engine_runs_fsdp(plan: PlacementPlan, role: str) -> bool:
    """Whether the engine can train ``role`` of ``plan`` under Megatron-FSDP: with ``dp > 1``
    (where it shards anything), on every device of the plan with ``pp = 1`` (megatron-core
    0.16.1's adapter meshes the whole world as DP x TP) and without a shadow (which copies whole
    weights the model does not hold); the engine does not offload it either."""
    model = plan[role]
    shadowed = any(SHADOW_OF[shadow] == role for shadow in plan.models if shadow in SHADOW_OF)
    return (model.spec.trainable and model.dp > 1 and model.pp == 1
            and model.size == plan.world_size and not shadowed)


def engine_runs_optimizer_offload(plan: PlacementPlan, role: str,
                                  profiles: tuple[HardwareProfile, ...]) -> bool:
    """Whether the engine can keep ``role``'s optimizer on the host and the planner can price
    it: a model trained in full under the distributed optimizer (whose shard megatron offloads;
    not Megatron-FSDP's, and ``option_menu`` offers it with the distributed optimizer alone),
    on devices whose profile knows the host memory of their nodes (GPU profiles; the engine
    refuses it without CUDA)."""
    model = plan[role]
    pools = {plan.cluster.locate(rank).pool_index for rank in model.ranks}
    return (model.spec.trainable and model.spec.distributed_optimizer
            and not model.spec.adapter_params
            and all(profiles[pool].host_memory_gib > 0 for pool in pools))


@dataclass(frozen=True)
class RoleMemory:
    """Memory of one model on one of its devices, GiB.

    Attributes:
        weights: bf16 weights (this device's shard of them under FSDP).
        grads: fp32 gradient buffers.
        optimizer: fp32 master weights and Adam moments.
        activations: the largest working set outside generation (forward or training
            activations, with the layers FSDP gathers).
        kv_cache: working set of one generation micro-batch: its KV cache, the prefill's
            activations, the weights FSDP gathers for generation.
        offloaded: the states live on the host between stages.
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    offloaded: bool

    @property
    def total(self) -> float:
        """Everything this model needs while its largest stage runs; an offloaded model brings
        back only its weights to generate."""
        states = self.weights + self.grads + self.optimizer
        generating = (self.weights if self.offloaded else states) + self.kv_cache
        return max(states + self.activations, generating)


@dataclass
class MemoryReport:
    """The memory side of a prediction.

    Attributes:
        options: per model, the memory options chosen (every option together when nothing
            fits).
        roles: per model, its memory on one device.
        sequences_per_round: per generating model, the most sequences one replica holds in a
            round (the KV-cache bound).
        generation_micro_batch: per generating model, the sequences one replica generates
            together (rows per replica spread evenly over the rounds): the engine's
            ``generation.micro_batch_size``.
        offloaded: models that are swapped to the host between stages.
        peak_gib: the most memory any device uses.
        host_gib: the most host memory any node's offloaded states and host optimizers use.
        usable_gib: the usable memory of that device.
        largest_batch: the KV cache's room over all generating replicas: the sequences they
            hold in one round (``sequences_per_round`` times each model's DP size), the largest
            rollout batch one round can generate.
        largest_micro_batch: per trainable model, the largest micro-batch its training fits.
        problems: why the plan cannot run (empty when it can), each with a fix.
    """

    options: dict[str, MemoryOptions] = field(default_factory=dict)
    roles: dict[str, RoleMemory] = field(default_factory=dict)
    sequences_per_round: dict[str, int] = field(default_factory=dict)
    generation_micro_batch: dict[str, int] = field(default_factory=dict)
    offloaded: set[str] = field(default_factory=set)
    peak_gib: float = 0.0
    host_gib: float = 0.0
    usable_gib: float = 0.0
    largest_batch: int = 0
    largest_micro_batch: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Use:
    """One stage of a model on one device: what it brings back when offloaded (``onload``),
    its working memory (``working``), and whether it trains."""

    onload: float
    working: float
    training: bool = False


@dataclass(frozen=True)
class _Needs:
    """Bytes one model needs on one device: its states, its stages, its generation, and what it
    keeps on the host."""

    state: cm.StateBytes
    host: float
    uses: tuple[_Use, ...]
    generation: _Use | None
    kv_per_sequence: float
    train_per_row: float


def role_state(model: ModelPlacement, options: MemoryOptions) -> cm.StateBytes:
    """The model's states on one of its devices under ``options`` (its experts split over its
    ``ep``; with LoRA adapters, gradients and optimizer state for them alone; none with the
    optimizer on the host)."""
    spec = model.spec
    state = cm.state_bytes(spec.num_params(), model.tp, model.pp, model.dp, spec.trainable,
                           options.sharding, spec.arch.expert_params(), spec.ep,
                           spec.adapter_params)
    return replace(state, optimizer=0.0) if options.optimizer_offload else state


def host_bytes(model: ModelPlacement, options: MemoryOptions) -> float:
    """Host memory that one device of the model uses: the optimizer shard on the host
    (``cm.HOST_OPTIMIZER_BYTES`` per parameter), and the device states of an offloaded model,
    whose host copies the engine keeps between stages."""
    offloaded = role_state(model, options).total if options.offload else 0.0
    if not options.optimizer_offload:
        return offloaded
    shard = role_state(model, replace(options, optimizer_offload=False)).optimizer
    return offloaded + shard / cm.ADAM_STATE_BYTES * cm.HOST_OPTIMIZER_BYTES


def _needs(model: ModelPlacement, rollout: RolloutSpec, options: MemoryOptions, forward: bool,
           generates: bool) -> _Needs:
    arch, tp, pp = model.spec.arch, model.tp, model.pp
    seq, mbs = rollout.activation_sequence_length, rollout.micro_batch_size
    value_head = model.role in VALUE_HEAD_ROLES
    state = role_state(model, options)
    fsdp = options.sharding == cm.FULLY_SHARDED
    uses, per_row = [], 0.0
    if forward:
        work = cm.forward_activation_bytes(arch, seq, mbs, tp, value_head)
        gathered = cm.fsdp_gathered_bytes(arch, tp, training=False) if fsdp else 0.0
        uses.append(_Use(state.weights, work + gathered))
    if model.spec.trainable:
        rows = math.ceil(rollout.batch / rollout.num_minibatches / model.dp)
        microbatches = math.ceil(rows / mbs)
        train = [cm.training_activation_bytes(arch, seq, size, tp, pp, microbatches,
                                              options.recompute, value_head)
                 for size in (1, mbs)]
        gathered = cm.fsdp_gathered_bytes(arch, tp, training=True) if fsdp else 0.0
        uses.append(_Use(state.total, train[1] + gathered, training=True))
        per_row = train[0]
    generation, kv = None, 0.0
    if generates:
        # The prefill's layer activations and the gathered fp32 logits of the last token sit
        # next to the static KV cache of the whole sequence.
        kv = (cm.kv_cache_bytes(arch, tp, pp, 1, rollout.sequence_length)
              + cm.layer_activation_bytes(arch, rollout.prompt_length, 1, tp)
              + cm.logits_bytes(arch, 1, 1, training=False))
        # Each decoding step gathers the layers as a forward pass does.
        gathered = cm.fsdp_gathered_bytes(arch, tp, training=False) if fsdp else 0.0
        generation = _Use(state.weights, gathered)
    return _Needs(state, host_bytes(model, options), tuple(uses), generation, kv, per_row)


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
                profiles: tuple[HardwareProfile, ...],
                options: dict[str, MemoryOptions] | None = None) -> MemoryReport:
    """Check every device of the plan under fixed memory options and size the generation rounds.

    Args:
        plan: the placement.
        rollout: the step's shapes.
        profiles: the profile of every pool, in pool order.
        options: per model; default ``base_options`` (what the request asks for).
    """
    options = options or {role: base_options(plan[role], rollout) for role in plan.roles}
    gen, fwd = generating_roles(plan), experience_roles(plan)
    needs = {role: _needs(plan[role], rollout, options[role], role in fwd, role in gen)
             for role in plan.roles}
    report = MemoryReport(options=dict(options),
                          offloaded={role for role in plan.roles if options[role].offload})
    capacity = {role: math.inf for role in gen}
    host: dict[int, float] = {}
    for ranks, pool, roles in _atoms(plan):
        node = plan.cluster.locate(ranks.start).node
        host[node] = host.get(node, 0.0) + len(ranks) * sum(needs[r].host for r in roles)
        usable = profiles[pool].usable_bytes
        report.usable_gib = max(report.usable_gib, usable / _GIB)
        resident = sum(needs[role].state.total for role in roles if role not in report.offloaded)
        for role in roles:
            offloaded = role in report.offloaded
            for use in needs[role].uses:
                free = usable - resident - (use.onload if offloaded else 0.0)
                _check_use(report, role, needs[role], use, free, ranks, rollout)
            if needs[role].generation is not None:
                use = needs[role].generation
                free = usable - resident - (use.onload if offloaded else 0.0) - use.working
                _check_generation(report, role, needs[role], free, ranks)
                capacity[role] = min(capacity[role], max(free, 0) // needs[role].kv_per_sequence)
    report.sequences_per_round = {role: int(capacity[role]) for role in gen}
    report.host_gib = max(host.values(), default=0.0) / _GIB
    _check_host(report, plan, profiles, host)
    if not report.problems:
        _finish(report, plan, rollout, needs)
    return report


def _check_use(report: MemoryReport, role: str, need: _Needs, use: _Use, free: float,
               ranks: range, rollout: RolloutSpec) -> None:
    """Record what does not fit for one stage of ``role`` on ``ranks``, with ``free`` bytes left
    for its working memory."""
    where = f"{role} on ranks [{ranks.start}, {ranks.stop})"
    if free <= 0:
        report.problems.append(
            f"{where}: its states need {need.state.total / _GIB:.1f} GiB next to the other "
            f"models', more than the device holds even with {report.options[role].label}: "
            f"raise {role}.tp or {role}.pp, or give it more devices")
        return
    if use.training:
        fits = int(free // need.train_per_row)
        report.largest_micro_batch[role] = min(report.largest_micro_batch.get(role, fits), fits)
    if use.working > free:
        report.problems.append(
            f"{where}: activations of micro_batch_size={rollout.micro_batch_size} need "
            f"{use.working / _GIB:.1f} GiB, {free / _GIB:.1f} GiB are left even with "
            f"{report.options[role].label}: lower rollout.micro_batch_size")


def _check_host(report: MemoryReport, plan: PlacementPlan,
                profiles: tuple[HardwareProfile, ...], host: dict[int, float]) -> None:
    """Record each node whose offloaded states and host optimizers exceed its host memory (not
    checked where the profile does not know it)."""
    for node in plan.cluster.nodes():
        usable = profiles[node.pool_index].host_usable_bytes
        if usable and host.get(node.index, 0.0) > usable:
            report.problems.append(
                f"node {node.index}: the states offloaded to its host need "
                f"{host[node.index] / _GIB:.0f} GiB, more than the {usable / _GIB:.0f} GiB "
                "usable of its host memory: give the models more nodes")


def _check_generation(report: MemoryReport, role: str, need: _Needs, free: float,
                      ranks: range) -> None:
    if free < need.kv_per_sequence:
        report.problems.append(
            f"{role} on ranks [{ranks.start}, {ranks.stop}): no room for the KV cache of one "
            f"sequence ({need.kv_per_sequence / _GIB:.2f} GiB) even with "
            f"{report.options[role].label}: raise {role}.tp or shorten the sequences")


def _finish(report: MemoryReport, plan: PlacementPlan, rollout: RolloutSpec,
            needs: dict[str, _Needs]) -> None:
    """Fill the per-role breakdown, the generation micro-batches, the peak device memory and the
    largest one-round batch."""
    rows = generation_rows(plan, rollout.batch)
    kv_used = {}
    for role, per_pool in rows.items():
        most = max(per_pool.values())
        cap = report.sequences_per_round[role]
        report.generation_micro_batch[role] = math.ceil(most / math.ceil(most / cap))
        kv_used[role] = (report.generation_micro_batch[role] * needs[role].kv_per_sequence
                         + needs[role].generation.working)
        report.largest_batch += cap * plan[role].dp
    for role in plan.roles:
        state, need = needs[role].state, needs[role]
        working = max((use.working for use in need.uses), default=0.0)
        report.roles[role] = RoleMemory(
            state.weights / _GIB, state.grads / _GIB, state.optimizer / _GIB, working / _GIB,
            kv_used.get(role, 0.0) / _GIB, role in report.offloaded)
    for _, _, roles in _atoms(plan):
        resident = sum(needs[r].state.total for r in roles if r not in report.offloaded)
        peak = 0.0
        for role in roles:
            uses = [*needs[role].uses]
            if role in kv_used:
                uses.append(_Use(needs[role].generation.onload, kv_used[role]))
            for use in uses:
                brought = use.onload if role in report.offloaded else 0.0
                peak = max(peak, resident + brought + use.working)
        report.peak_gib = max(report.peak_gib, peak / _GIB)


def fit_memory(plan: PlacementPlan, rollout: RolloutSpec, profiles: tuple[HardwareProfile, ...],
               price: Callable[[str, MemoryOptions], float],
               allowed: tuple[str, ...] = MEMORY_OPTIONS) -> MemoryReport:
    """The cheapest memory options with which every device fits, and the memory they give.

    Combinations of every model's ``option_menu`` are tried by the number of models with the
    optimizer on the host, then by increasing total price (then by the number of options used):
    the host's Adam rate is an assumption of the profile, not a measurement, so the planner
    moves an optimizer to the host only for a plan that fits no other way. A shadow is
    offloaded with the model it copies (the engine's policy). When even every option together
    does not fit, that report is returned, with its problems.

    Args:
        plan: the placement.
        rollout: the step's shapes.
        profiles: the profile of every pool, in pool order.
        price: seconds a model's stages take under some options (``predict`` prices them with
            the stage formulas, offload copies included).
        allowed: the options that may be added (of ``MEMORY_OPTIONS``).

    Raises:
        ValueError: an unknown name in ``allowed``.
    """
    check_memory_options(allowed)
    menus = {role: option_menu(plan[role], rollout, allowed, engine_runs_fsdp(plan, role),
                               engine_runs_optimizer_offload(plan, role, profiles))
             for role in plan.roles if role not in SHADOW_OF}
    # The most each model can save: FSDP with recomputation, or without FSDP every other option
    # together (FSDP is never offloaded); if no mix of them fits, nothing does.
    most = {role: list(dict.fromkeys([menu[-1], [o for o in menu if o.sharding != FSDP][-1]]))
            for role, menu in menus.items()}
    reports = [plan_memory(plan, rollout, profiles,
                           _with_shadows(plan, dict(zip(menus, combo, strict=True))))
               for combo in itertools.product(*most.values())]
    if all(report.problems for report in reports):
        return reports[0]
    roles = list(menus)
    prices = {(role, o): price(role, o) + _shadow_price(plan, role, o, price)
              for role, menu in menus.items() for o in menu}
    rank = {(role, o): i for role, menu in menus.items() for i, o in enumerate(menu)}

    def cost(combo: tuple[MemoryOptions, ...]) -> tuple[int, float, int]:
        pairs = list(zip(roles, combo, strict=True))
        hosted = sum(o.optimizer_offload for o in combo)
        return hosted, sum(prices[p] for p in pairs), sum(rank[p] for p in pairs)

    ordered = sorted(itertools.product(*menus.values()), key=cost)
    reports = (plan_memory(plan, rollout, profiles,
                           _with_shadows(plan, dict(zip(roles, combo, strict=True))))
               for combo in ordered)
    # A combination of the most options is among them and fits, so one is found.
    return next(report for report in reports if not report.problems)


def _with_shadows(plan: PlacementPlan, options: dict[str, MemoryOptions]) -> dict[str,
                                                                                 MemoryOptions]:
    """Add the shadows' options: offloaded when the model they copy is."""
    shadows = {shadow: MemoryOptions(offload=options[trainer].offload)
               for shadow, trainer in SHADOW_OF.items() if shadow in plan.models}
    return {**options, **shadows}


def _shadow_price(plan: PlacementPlan, role: str, options: MemoryOptions,
                  price: Callable[[str, MemoryOptions], float]) -> float:
    """What ``options`` cost the shadow of ``role`` (its offloading), if it has one."""
    shadows = [s for s, trainer in SHADOW_OF.items() if trainer == role and s in plan.models]
    return sum(price(s, MemoryOptions(offload=options.offload)) for s in shadows)
