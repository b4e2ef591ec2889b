"""The peak memory each rank is predicted to need per stage, and the ``auto`` offload decision.

    roles = planner_role_bytes(plan, config)
    peaks = stage_peaks(plan, roles, offloaded={"ref"})    # rank -> stage -> bytes
    offload = offload_policies(config, plan)               # role -> "never" | "always"

The per-model bytes are the planner's (``planner.memory``); this module applies the engine's
offload rules to them. Stages are named like the engine's spans, so a prediction lines up with the
``memory/<stage>_peak_bytes`` metrics, and it counts what the engine counts on the CPU: model
state (weights, gradient buffers, optimizer state; a Megatron-FSDP model's shards), the KV cache
of generation and the weights FSDP gathers while a model computes, not activations. Between
stages an offloaded model holds nothing on the device; an operator brings back what it needs,
one model at a time: the generating model's weights (``generate``), each scoring model's
weights (``experience``), all the state of each trained model (``train``), and a trained model's
weights with its shadow's (``sync_weights``).

A generating model that keeps its captured decode steps between calls (:func:`decode_graph_roles`)
keeps their KV memory too, one cache per slot count it decodes at, through every stage: that
memory is resident on its ranks, in the training peak of a rank it shares as well. Only a model
whose ranks train no model keeps them: where generation and training share devices (a shadow
beside the trained models it copies, under flattening) the graphs and their caches are freed at
the end of every generate call, as they are for a model that trains or is offloaded, since a
resident cache would only take memory from training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.generation.continuous import kept_slot_counts
from megatron_rlhf.generation.decode_step import batch_bucket, graphs_enabled, length_bucket
from megatron_rlhf.planner import RolloutSpec, load_profile, plan_memory
from megatron_rlhf.planner.cost_model import FULLY_SHARDED, fsdp_gathered_bytes, kv_cache_bytes
from megatron_rlhf.planner.memory_fit import base_options, experience_roles, generating_roles
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.models import SHADOW_OF, TRAINABLE_ROLES
from megatron_rlhf.topology.plan import PlacementPlan

logger = get_logger(__name__)

GENERATE, EXPERIENCE, TRAIN, SYNC = "generate", "experience", "train", "sync_weights"
_GIB = 1024**3

@dataclass(frozen=True)
class RoleBytes:
    """One model's bytes on one of its devices.

    Attributes:
        weights: parameters.
        grads: gradient buffers (trainable models).
        optimizer: optimizer state: fp32 main weights and Adam moments (trainable models).
        kv_cache: the KV cache of one generation round (generating models).
        gathered: the weights Megatron-FSDP gathers while the model computes (FSDP models):
            two layers and the embeddings (``planner.cost_model.fsdp_gathered_bytes``).
        kept_cache: the KV memory of the decoders a model that keeps its captured decode steps
            holds between calls (:func:`decode_graph_roles`), resident in every stage; 0: the
            cache lives only while the model generates.
    """

    weights: float
    grads: float = 0.0
    optimizer: float = 0.0
    kv_cache: float = 0.0
    gathered: float = 0.0
    kept_cache: float = 0.0

    @property
    def state(self) -> float:
        """Weights, gradients and optimizer state."""
        return self.weights + self.grads + self.optimizer


def decode_positions(config: RunConfig) -> int:
    """The most positions (prompt plus response) a generate call of the run decodes: the
    longest prompt plus ``generation.max_new_tokens``, or plus ``rollout.max_episode_tokens``
    for multi-turn episodes (their turns' contexts grow to it)."""
    rollout = config.rollout
    episodes = bool(rollout.tools or rollout.environment)
    return rollout.max_prompt_length + (rollout.max_episode_tokens if episodes
                                        else config.generation.max_new_tokens)


def graphs_captured(config: RunConfig, device: torch.device) -> bool:
    """Whether the run's generating models capture their decode steps on ``device``
    (``generation.cuda_graphs``; never an MoE model, whose token dispatch synchronises with
    the host)."""
    return graphs_enabled(config.generation, device) and not config.models.moe.enabled


def decode_graph_roles(plan: PlacementPlan, offload: Mapping[str, str], graphs: bool
                       ) -> set[str]:
    """The generating models that keep their captured decode steps, and the KV memory under
    them, from one generate call to the next (module docstring): those not trained, not
    offloaded (``offload[role] != "always"``) and on no rank of a trained model.

    Args:
        plan: the placement.
        offload: every placed model's offload policy (``auto`` counts as resident).
        graphs: whether the decode steps are captured at all (:func:`graphs_captured`).
    """
    if not graphs:
        return set()
    trained = [plan[role] for role in TRAINABLE_ROLES if role in plan.models]
    return {role for role in generating_roles(plan)
            if role not in TRAINABLE_ROLES and offload.get(role) != "always"
            and not any(plan[role].overlaps(other) for other in trained)}


def planner_role_bytes(plan: PlacementPlan, config: RunConfig, kept: Collection[str] = ()
                       ) -> dict[str, RoleBytes]:
    """The planner's bytes of every model of ``plan`` for the run ``config`` (bf16 weights, fp32
    gradient buffers, mixed-precision Adam; sharded over DP under ``<role>_optimizer.fsdp``),
    with a generation round of at most ``generation.micro_batch_size`` rows when that is set,
    and the kept KV memory of the models in ``kept`` (:func:`decode_graph_roles`)."""
    rollout = RolloutSpec.from_run_config(config)
    # Memory large enough that nothing is offloaded and one round holds the whole batch.
    unlimited = dataclasses.replace(load_profile("A100-80GB"), memory_gib=2.0**40)
    fsdp = fsdp_roles(config, plan)
    options = {role: base_options(plan[role], rollout) for role in plan.roles}
    options.update({role: dataclasses.replace(options[role], sharding=FULLY_SHARDED)
                    for role in fsdp})
    report = plan_memory(plan, rollout, (unlimited,) * len(plan.cluster.pools), options)
    # The planner's generation working set also holds the prefill's activations and the logits,
    # which the engine does not count on the CPU: only the static KV cache of the round.
    # Continuous batching's cache has a power-of-two count of slots, each a length bucket long.
    bound = config.generation.micro_batch_size
    continuous = config.generation.continuous
    length = (length_bucket(rollout.sequence_length) if continuous else rollout.sequence_length)
    kv_cache = {role: (batch_bucket(rows, bound) if continuous else min(rows, bound or rows))
                * kv_cache_bytes(plan[role].spec.arch, plan[role].tp, plan[role].pp, 1, length)
                for role, rows in report.generation_micro_batch.items()}
    # A kept model's decoders are as long as the longest call of the run, one per slot count.
    kept_cache = {role: sum(kept_slot_counts(rows, bound)) * kv_cache_bytes(
                      plan[role].spec.arch, plan[role].tp, plan[role].pp, 1,
                      length_bucket(decode_positions(config)))
                  for role, rows in report.generation_micro_batch.items() if role in kept}
    # What the CPU meter sees gathered: the weights at each layer's forward (on a GPU the
    # allocator also sees the backward's gradient buckets, which the planner's fit adds).
    gathered = {role: fsdp_gathered_bytes(plan[role].spec.arch, plan[role].tp, training=False)
                for role in fsdp}
    return {role: RoleBytes(m.weights * _GIB, m.grads * _GIB, m.optimizer * _GIB,
                            kv_cache.get(role, 0.0), gathered.get(role, 0.0),
                            kept_cache.get(role, 0.0))
            for role, m in report.roles.items()}


def fsdp_roles(config: RunConfig, plan: PlacementPlan) -> set[str]:
    """The placed models trained under Megatron-FSDP (``<role>_optimizer.fsdp=true``)."""
    return {role for role in TRAINABLE_ROLES
            if role in plan.models and config.optimizer(role).fsdp}


def stage_peaks(plan: PlacementPlan, roles: dict[str, RoleBytes], offloaded: Collection[str]
                ) -> dict[int, dict[str, float]]:
    """Predicted peak bytes of every model stage each rank runs (rank -> stage -> bytes).

    Args:
        plan: the placement.
        roles: every placed model's bytes (:func:`planner_role_bytes`).
        offloaded: the placed models that are offloaded between stages.
    """
    units = {GENERATE: [(role,) for role in generating_roles(plan)],
             EXPERIENCE: [(role,) for role in experience_roles(plan)],
             TRAIN: [(role,) for role in TRAINABLE_ROLES if role in plan.models],
             SYNC: [(trained, shadow) for shadow, trained in SHADOW_OF.items()
                    if shadow in plan.models]}
    peaks: dict[int, dict[str, float]] = {}
    for rank in range(plan.world_size):
        here = set(plan.roles_on(rank))
        # a kept KV cache is never offloaded: it stays through every stage
        resident = sum(roles[role].state for role in here if role not in offloaded) + sum(
            roles[role].kept_cache for role in here)
        peaks[rank] = {}
        for stage, stage_units in units.items():
            running = [[role for role in unit if role in here] for unit in stage_units]
            running = [unit for unit in running if unit]
            if running:
                peaks[rank][stage] = resident + max(
                    sum(_brought_back(stage, roles[role], role in offloaded) for role in unit)
                    for unit in running)
    return peaks


def _brought_back(stage: str, role: RoleBytes, offloaded: bool) -> float:
    """Bytes a stage adds for one of its models: what an offloaded model brings back, plus the
    generation's KV cache and the weights FSDP gathers (both alive while a decoding step
    computes; ``sync_weights`` computes nothing). A kept KV cache is resident already."""
    cache = role.kv_cache if stage == GENERATE and not role.kept_cache else 0.0
    work = cache + (role.gathered if stage != SYNC else 0.0)
    if not offloaded:
        return work
    return (role.state if stage == TRAIN else role.weights) + work


def offload_policies(config: RunConfig, plan: PlacementPlan, graphs: bool = False
                     ) -> dict[str, str]:
    """``never`` or ``always`` for every placed model, deciding ``models.offload.<role>=auto``.

    An ``auto`` model is offloaded when a rank it is placed on is predicted to exceed the
    per-rank budget (``models.memory_budget_gib``, or the device memory of the rank's pool) in
    some stage with every ``auto`` model resident; ``always`` models count as offloaded. With
    ``graphs`` (:func:`graphs_captured`) a resident model of :func:`decode_graph_roles` counts
    its kept KV memory; offloading it frees that too.
    """
    policies = {role: config.models.offload_policy(role) for role in plan.roles}
    auto = {role for role, policy in policies.items() if policy == "auto"}
    if auto:
        roles = planner_role_bytes(plan, config, decode_graph_roles(plan, policies, graphs))
        always = {role for role, policy in policies.items() if policy == "always"}
        peaks = stage_peaks(plan, roles, always)
        over = {rank for rank, stages in peaks.items()
                if max(stages.values(), default=0.0) > budget_bytes(config, plan, rank)}
        for role in auto:
            policies[role] = "always" if over & set(plan[role].ranks) else "never"
        logger.info("models.offload=auto: %s (ranks over the budget: %s)",
                    {role: policies[role] for role in sorted(auto)}, sorted(over))
    return policies


def budget_bytes(config: RunConfig, plan: PlacementPlan, rank: int) -> float:
    """The memory budget of one rank: ``models.memory_budget_gib``, or its device's memory."""
    gib = config.models.memory_budget_gib
    if not gib:
        gib = plan.cluster.pools[plan.cluster.locate(rank).pool_index].memory_gib
    return gib * _GIB
