"""Automatic placement: enumerate candidate placements, predict each, rank by samples/s.

    ranked = auto_place(homogeneous_cluster("A100-80GB", 4, 8), "llama-13b",
                        RolloutSpec(batch=1024, prompt_length=256, generation_length=256))
    best = ranked[0].config            # a PlacementConfig, ready for plan_placement / run_ppo
    explain_choice(ranked)             # why the best one wins

Candidates: for every TP (a divisor of the node size that divides the heads and query groups of
every model) and PP (a divisor of the layers, at most ``max_pp``): the presets flattening,
interleaving (also with ref and reward at half the PP) and interleaving2; custom ratio vectors from a grid; separation for each
``train_fraction`` and shadow TP; hetero-separation (when the cluster has two or more pools) for
each shadow TP. For mixture-of-experts models, each of those again with every expert-parallel
size up to ``max_ep`` that divides the experts, set for every placed MoE model (shadows
included). Requests the placement refuses (e.g. an ``ep`` that does not divide a model's DP size)
are skipped; identical plans are kept once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatron_rlhf.planner.hardware import HardwareProfile
from megatron_rlhf.planner.memory_fit import MEMORY_OPTIONS, check_memory_options
from megatron_rlhf.planner.predict import STAGES, StepPrediction, predict_step
from megatron_rlhf.planner.workload import RolloutSpec
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    SHADOW_OF,
    ArchSpec,
    arch_preset,
)
from megatron_rlhf.topology.placement import plan_placement
from megatron_rlhf.topology.placement_config import (
    CUSTOM,
    FLATTENING,
    HETERO_SEPARATION,
    INTERLEAVING,
    INTERLEAVING2,
    SEPARATION,
    ParallelOverride,
    PlacementConfig,
)
from megatron_rlhf.topology.plan import PlacementPlan

if TYPE_CHECKING:  # the planner imports no torch, which models.options does
    from megatron_rlhf.models.options import LoRAConfig

ArchLike = str | ArchSpec
DEFAULT_RATIO_GRID = ((1.0, 1.0, 0.25, 0.25), (1.0, 1.0, 0.5, 0.25), (1.0, 1.0, 0.25, 0.5),
                      (0.5, 0.5, 0.25, 0.25))
"""Custom ratio vectors over [actor, critic, ref, reward] tried besides the presets (without a
critic, the critic entry is dropped; without a reward or reference model, vectors that differ only
in its entry are tried once)."""


@dataclass(frozen=True)
class SearchSpace:
    """Which candidates ``auto_place`` tries.

    Attributes:
        strategies: strategies to try (``custom`` means the ratio grid); None for all that apply.
        tps: TP sizes to try; None for every valid one.
        pps: PP sizes to try; None for the divisors of the layers up to ``max_pp``.
        max_pp: largest PP tried when ``pps`` is None.
        eps: expert-parallel sizes to try on mixture-of-experts models; None for 1 and every
            divisor of the experts up to ``max_ep``. Dense models always run at 1.
        max_ep: largest EP tried when ``eps`` is None.
        train_fractions: separation splits tried.
        ratio_grid: custom ratio vectors tried.
        ac_share: plan with AC-Share (no critic).
        critic: plan a value model at all; False prices the three-model step of the critic-free
            estimators (grpo, rloo, reinforce++), without interleaving2.
        reward: plan a reward model at all; False prices a step scored by rules and reward
            functions alone (``reward.model_weight=0``).
        reference: plan a reference model at all; False prices a step whose reference
            log-probs come from the actor's base (LoRA on the actor).
        lora: the LoRA adapters of the trained models (``models.lora``): their trainers are
            priced with adapter-only gradients, optimizer state and weight syncs and no weight
            gradient for the frozen base; None (or rank 0): every weight trains.
        distributed_optimizer: shard optimizer state over DP (never costs time, saves memory).
        memory_options: the memory options the planner may add to every candidate
            (``memory.MEMORY_OPTIONS``).
    """

    strategies: tuple[str, ...] | None = None
    tps: tuple[int, ...] | None = None
    pps: tuple[int, ...] | None = None
    max_pp: int = 8
    eps: tuple[int, ...] | None = None
    max_ep: int = 16
    train_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)
    ratio_grid: tuple[tuple[float, float, float, float], ...] = DEFAULT_RATIO_GRID
    ac_share: bool = False
    critic: bool = True
    reward: bool = True
    reference: bool = True
    lora: LoRAConfig | None = None
    distributed_optimizer: bool = True
    memory_options: tuple[str, ...] = MEMORY_OPTIONS

    def __post_init__(self) -> None:
        for name in ("max_pp", "max_ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"search.{name}={getattr(self, name)} must be >= 1")
        check_memory_options(self.memory_options)
        for name in ("tps", "pps", "eps"):
            values = getattr(self, name)
            if values is not None and (not values or min(values) < 1):
                raise ValueError(f"search.{name}={values} must list sizes >= 1, or be None")


@dataclass(frozen=True)
class RankedCandidate:
    """One candidate placement with its prediction.

    Attributes:
        rank: 1 for the best.
        label: short description (``describe``), e.g. ``separation(8/16 train) tp=4 pp=1
            shadow_tp=2``.
        config: the placement request (give it to ``plan_placement`` or ``run_ppo``).
        plan: the plan it gives.
        prediction: the predicted step.
    """

    rank: int
    label: str
    config: PlacementConfig
    plan: PlacementPlan
    prediction: StepPrediction

    def to_dict(self) -> dict:
        """JSON-ready summary (keys documented in ``docs/planner.md``)."""
        p = self.prediction
        return {"rank": self.rank, "label": self.label, "placement": self.config.to_dict(),
                "feasible": p.feasible, "samples_per_s": round(p.samples_per_s, 4),
                "step_seconds": round(p.step_seconds, 4) if p.feasible else None,
                "bottleneck": p.bottleneck,
                "stage_seconds": {k: round(v, 4) for k, v in p.stage_seconds.items()},
                "peak_gib_per_device": round(p.memory.peak_gib, 2) if p.feasible else None,
                "memory_options": {role: o.label for role, o in p.memory.options.items()},
                "problems": list(p.problems)}


def _archs(models: ArchLike | Mapping[str, ArchLike]) -> dict[str, ArchSpec]:
    """Role -> architecture (one for all four roles when ``models`` is one)."""
    if isinstance(models, str | ArchSpec):
        return dict.fromkeys((ACTOR, CRITIC, REF, REWARD), arch_preset(models))
    return {role: arch_preset(arch) for role, arch in models.items()}


def parallel_sizes(cluster: ClusterSpec, archs: list[ArchSpec],
                   space: SearchSpace) -> tuple[list[int], list[int]]:
    """The TP and PP sizes to try: TP divides every node size, heads and query groups; PP
    divides every model's layers and is at most ``space.max_pp``."""
    node = math.gcd(*(pool.devices_per_node for pool in cluster.pools))
    heads = math.gcd(*(math.gcd(a.num_attention_heads, a.num_query_groups) for a in archs))
    tps = [t for t in range(1, node + 1) if node % t == 0 and heads % t == 0]
    layers = math.gcd(*(a.num_layers for a in archs))
    pps = [p for p in range(1, min(space.max_pp, layers) + 1) if layers % p == 0]
    return ([t for t in tps if space.tps is None or t in space.tps],
            [p for p in pps if space.pps is None or p in space.pps])


def expert_parallel_sizes(archs: Mapping[str, ArchSpec], space: SearchSpace) -> list[int]:
    """The EP sizes to try: 1, and for mixture-of-experts models every size up to
    ``space.max_ep`` that divides the experts of each of them (``space.eps`` when given)."""
    experts = [a.experts.num_experts for a in archs.values() if a.experts is not None]
    if not experts:
        return [1]
    common = math.gcd(*experts)
    sizes = [e for e in range(1, min(space.max_ep, common) + 1) if common % e == 0]
    return [1] + [e for e in sizes if e > 1 and (space.eps is None or e in space.eps)]


def with_expert_parallelism(config: PlacementConfig, moe_roles: frozenset[str],
                            ep: int) -> PlacementConfig:
    """``config`` with expert-parallel size ``ep`` for each mixture-of-experts model it places
    (a shadow as the model it copies), other per-role settings kept."""
    placed = list(config.base_roles) + [shadow for shadow, base in SHADOW_OF.items()
                                        if config.separated and base in config.base_roles]
    parallel = dict(config.parallel)
    for role in placed:
        if SHADOW_OF.get(role, role) in moe_roles:
            parallel[role] = replace(parallel.get(role, ParallelOverride()), ep=ep)
    return replace(config, parallel=parallel)


def candidate_configs(cluster: ClusterSpec, models: ArchLike | Mapping[str, ArchLike],
                      space: SearchSpace) -> list[PlacementConfig]:
    """Every placement request of the search space, before planning (``models`` as
    ``auto_place`` takes them)."""
    archs = _archs(models)
    tps, pps = parallel_sizes(cluster, list(archs.values()), space)

    def wanted(strategy: str) -> bool:
        return space.strategies is None or strategy in space.strategies

    common = {"ac_share": space.ac_share, "critic": space.critic, "reward": space.reward,
              "reference": space.reference, "distributed_optimizer": space.distributed_optimizer}
    with_critic = space.critic and not space.ac_share
    shadow_roles = ("shadow_actor", "shadow_critic") if with_critic else ("shadow_actor",)
    presets = (FLATTENING, INTERLEAVING, INTERLEAVING2) if space.critic else (FLATTENING,
                                                                                INTERLEAVING)
    grid = ([list(r) for r in space.ratio_grid] if space.critic
            else list(dict.fromkeys((r[0], r[2], r[3]) for r in space.ratio_grid)))
    # the ref and reward entries of a list are unused when those models are not placed: one
    # vector per placed roles' ratios
    placed = (space.reference, space.reward)
    firsts: dict[tuple, list[float]] = {}
    for ratios in grid:
        key = (*ratios[:-2], *(r for r, kept in zip(ratios[-2:], placed, strict=True) if kept))
        firsts.setdefault(key, list(ratios))
    grid = list(firsts.values())
    found: list[PlacementConfig] = []
    for tp in tps:
        for pp in pps:
            found += [PlacementConfig(strategy, tp=tp, pp=pp, **common)
                      for strategy in presets if wanted(strategy)]
            if wanted(INTERLEAVING) and pp // 2 in pps:
                # ref and reward each get half the devices: half the pipeline lets the trainers
                # keep a deep one (llama-65b on 2x8 fits only so).
                halves = {role: ParallelOverride(pp=pp // 2) for role, placed in
                          ((REF, space.reference), (REWARD, space.reward)) if placed}
                if halves:
                    found.append(PlacementConfig(INTERLEAVING, tp=tp, pp=pp, parallel=halves,
                                                 **common))
            if wanted(CUSTOM):
                found += [PlacementConfig(CUSTOM, ratios=list(r), tp=tp, pp=pp, **common)
                          for r in grid]
            for shadow_tp in tps:
                shadows = {role: ParallelOverride(tp=shadow_tp) for role in shadow_roles}
                if wanted(SEPARATION):
                    found += [PlacementConfig(SEPARATION, train_fraction=f, tp=tp, pp=pp,
                                              parallel=dict(shadows), **common)
                              for f in space.train_fractions]
                if len(cluster.pools) > 1 and wanted(HETERO_SEPARATION):
                    found.append(PlacementConfig(HETERO_SEPARATION, tp=tp, pp=pp,
                                                 parallel=dict(shadows), **common))
    moe_roles = frozenset(role for role, arch in archs.items() if arch.experts is not None)
    return found + [with_expert_parallelism(config, moe_roles, ep)
                    for ep in expert_parallel_sizes(archs, space)[1:] for config in found]


def describe(plan: PlacementPlan) -> str:
    """A short label of a plan: strategy (ratios, or the devices that train), tp, pp, shadow tp,
    and the largest expert-parallel size where one is above 1.

    E.g. ``flattening tp=4 pp=1``, ``custom[1, 1, 0.25, 0.25] tp=2 pp=1``,
    ``separation(8/16 train) tp=4 pp=2 shadow_tp=2``, ``flattening tp=1 pp=1 ep=8``.
    """
    config, actor = plan.config, plan["actor"]
    name = config.strategy
    if config.strategy == CUSTOM:
        name += "[" + ", ".join(f"{r:g}" for r in config.ratios or ()) + "]"
    elif config.strategy == SEPARATION:
        name += f"({actor.size}/{plan.world_size} train)"
    label = f"{name} tp={actor.tp} pp={actor.pp}"
    inference = next((plan[role] for role in (REF, REWARD) if role in plan.models), actor)
    if inference.pp != actor.pp:
        label += f" {inference.role}_pp={inference.pp}"
    if "shadow_actor" in plan.models:
        label += f" shadow_tp={plan['shadow_actor'].tp}"
    ep = max(m.spec.ep for m in plan.models.values())
    return label + (f" ep={ep}" if ep > 1 else "")


@contextmanager
def _quiet_planner() -> Iterator[None]:
    """Silence the placement's crowding warnings while searching: the cost model prices the
    offloading they announce."""
    placement_logger = logging.getLogger("megatron_rlhf.topology.placement")
    level = placement_logger.level
    placement_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        placement_logger.setLevel(level)


def _signature(plan: PlacementPlan) -> tuple:
    return tuple((role, m.rank_offset, m.size, m.tp, m.pp, m.spec.ep)
                 for role, m in plan.models.items())


def auto_place(cluster: ClusterSpec, models: ArchLike | Mapping[str, ArchLike],
               rollout: RolloutSpec | Callable[[PlacementPlan], RolloutSpec],
               profiles: Mapping[str, HardwareProfile] | HardwareProfile | None = None,
               space: SearchSpace | None = None) -> list[RankedCandidate]:
    """Rank every candidate placement by predicted samples/s, best first; one that fits only
    with an optimizer on the host ranks after every one that fits without (its price rests on
    the profile's assumed host Adam rate, as in ``memory_fit.fit_memory``).

    Args:
        cluster: the devices.
        models: one architecture for all models, or one per role (as ``plan_placement``).
        rollout: the step's shapes, or a function that gives them for a plan (a run's token
            budgets, and so its micro-batches, depend on which models share a device).
        profiles: device profiles (``hardware.resolve_profiles``).
        space: the candidates to try; default ``SearchSpace()``.

    Returns:
        Feasible candidates by decreasing samples/s, those with an optimizer on the host after
        the others, then those that do not fit in memory. Empty when the placement refuses
        every candidate.
    """
    space = space or SearchSpace()
    scored: list[tuple[str, PlacementConfig, PlacementPlan, StepPrediction]] = []
    seen: set[tuple] = set()
    adapters = space.lora.role_adapters(models) if space.lora else None
    with _quiet_planner():
        for config in candidate_configs(cluster, models, space):
            try:
                plan = plan_placement(cluster, config, models, adapters)
            except ValueError:
                continue
            if _signature(plan) in seen:
                continue
            seen.add(_signature(plan))
            shapes = rollout(plan) if callable(rollout) else rollout
            scored.append((describe(plan), config, plan,
                           predict_step(plan, shapes, profiles, space.memory_options)))
    scored.sort(key=lambda c: (not c[3].feasible, _hosts_an_optimizer(c[3]),
                               -c[3].samples_per_s))
    return [RankedCandidate(i + 1, *c) for i, c in enumerate(scored)]


def _hosts_an_optimizer(prediction: StepPrediction) -> bool:
    return any(o.optimizer_offload for o in prediction.memory.options.values())


def explain_choice(ranked: list[RankedCandidate]) -> str:
    """One sentence on why the best candidate wins over the best one of another strategy."""
    if not ranked:
        return "no candidate placement is valid on this cluster: see plan_placement's errors"
    best = ranked[0]
    if not best.prediction.feasible:
        return (f"no candidate fits in memory; for example {best.label}: "
                f"{best.prediction.problems[0]}")
    prediction = best.prediction
    others = [c for c in ranked[1:] if c.prediction.feasible]
    rival = next((c for c in others if c.config.strategy != best.config.strategy),
                 others[0] if others else None)
    text = f"{best.label} wins with {prediction.samples_per_s:.3g} samples/s"
    if rival is not None:
        ratio = prediction.samples_per_s / rival.prediction.samples_per_s
        text += f", {ratio:.2f}x {rival.label} ({rival.prediction.samples_per_s:.3g})"
        gains = {s: rival.prediction.stage_seconds[s] - prediction.stage_seconds[s]
                 for s in STAGES}
        stage = max(gains, key=gains.__getitem__)
        if gains[stage] > 0.05 * rival.prediction.step_seconds:
            text += (f": {stage} takes {prediction.stage_seconds[stage]:.3g} s against "
                     f"{rival.prediction.stage_seconds[stage]:.3g} s")
    if prediction.pipelined:
        text += (f"; generation overlaps training, so a step takes "
                 f"{prediction.step_seconds:.3g} s instead of "
                 f"{prediction.synchronous_step_seconds:.3g} s")
    return (f"{text}; its bottleneck is {prediction.bottleneck} "
            f"({prediction.bottleneck_share:.0%} of the critical work)")
