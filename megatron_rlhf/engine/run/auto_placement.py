"""``--placement auto``: let the planner choose the placement of a run.

The planner ranks candidate placements (presets, separation splits, TP/PP choices) by predicted
samples/s for this cluster, these models and this rollout; the best one the engine accepts (its
batch shapes must split over every model's DP size) replaces the configured placement, and the
memory options the planner needed for it to fit (offloading between stages, activation
recomputation, Megatron-FSDP) become ``models.offload``, ``models.recompute`` and
``<role>_optimizer.fsdp`` for every model the configuration leaves unset. The planner
picks FSDP only where the engine runs it (``planner.memory.engine_runs_fsdp``).
"""

from __future__ import annotations

import dataclasses

from megatron_rlhf.algorithms import get_off_policy
from megatron_rlhf.builder.sources import config_arch
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.engine.run.micro_batching import planner_rollout, token_budgets
from megatron_rlhf.planner import (
    AnswerLengths,
    MemoryOptions,
    RolloutSpec,
    SearchSpace,
    auto_place,
    explain_choice,
)
from megatron_rlhf.planner.local_profile import pool_profiles
from megatron_rlhf.planner.memory_fit import FSDP, OFFLOAD, OPTIMIZER_OFFLOAD, RECOMPUTE
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.models import SHADOW_OF, TRAINABLE_ROLES

ENGINE_MEMORY_OPTIONS = (FSDP, OFFLOAD, RECOMPUTE, OPTIMIZER_OFFLOAD)
"""The planner's memory options the engine runs (``<role>_optimizer.fsdp``, ``models.offload``,
``models.recompute``, ``<role>_optimizer.cpu_offload_fraction``)."""


def choose_placement(config: RunConfig, cluster: ClusterSpec, profile: str | None = None,
                     lengths: AnswerLengths | None = None) -> tuple[RunConfig, str]:
    """The run configuration with the planner's best placement, and why it won (with the
    profiles measured or read from the cache, ``planner.local_profile``).

    Args:
        config: the run; its placement's ``ac_share``, ``critic``, ``reward`` and ``reference``
            are kept.
        cluster: the devices of the job.
        profile: a hardware profile name or JSON path for every pool; None uses the shipped
            profile named like each pool's kind, and for a CPU run's ``local`` pool this
            machine's, measured once and cached (``planner.local_profile``).
        lengths: the answers' length distribution to price (None: every answer
            ``generation.max_new_tokens`` tokens).

    Raises:
        ValueError: no profile for a pool (named with ``--profile``), or no candidate the
            engine accepts.
    """
    profiles, notes = pool_profiles(cluster, profile)
    ranked = ranked_candidates(config, cluster, profiles, lengths)
    rejected = []
    for candidate in ranked:
        if not candidate.prediction.feasible:
            continue
        try:
            chosen = candidate_config(config, candidate)
            make_plan(chosen, cluster)
        except ValueError as error:
            rejected.append(f"{candidate.label}: {error}")
            continue
        return chosen, "; ".join([explain_choice(ranked[candidate.rank - 1:]), *notes])
    reasons = "; ".join(rejected[:3]) or explain_choice(ranked)
    raise ValueError(f"placement=auto found no placement this run can use ({reasons}); "
                     "choose one with --placement or adjust rollout sizes")


def ranked_candidates(config: RunConfig, cluster: ClusterSpec, profiles,
                      lengths: AnswerLengths | None = None) -> list:
    """The planner's candidate placements for ``config`` on ``cluster``, best first, with the
    memory options the engine runs; a critic-free (or reward-model-free) run is priced as the
    step with the models it has, each candidate with the micro-batches the run would fill at
    that placement (``planner_rollout``) and the answers ``lengths`` (None: all full-length)."""
    return auto_place(cluster, config_arch(config),
                      lambda plan: planner_rollout(config, token_budgets(config, plan),
                                                   answered_rollout(config, lengths)),
                      profiles, search_space(config))


def answered_rollout(config: RunConfig, lengths: AnswerLengths | None) -> RolloutSpec:
    """The run's shapes (``RolloutSpec.from_run_config``) with the answers ``lengths``, and the
    proximal forward of an off-policy correction that needs one."""
    proximal = get_off_policy(config.algorithm.off_policy).needs_proximal
    rollout = RolloutSpec.from_run_config(config, overlap=config.rollout.async_rollout,
                                          proximal_forward=proximal)
    return rollout.with_answer_lengths(lengths)


def search_space(config: RunConfig) -> SearchSpace:
    """The candidates the planner may give ``config``: the memory options the engine runs, and
    under MoE routing replay neither a pipelined policy nor full recomputation, which replay
    refuses (``RunConfig._check_router_replay``)."""
    replay = config.models.moe.enabled and config.models.moe.router_replay
    options = tuple(o for o in ENGINE_MEMORY_OPTIONS if not (replay and o == RECOMPUTE))
    return SearchSpace(critic=config.placement.critic, reward=config.placement.reward,
                       reference=config.placement.reference, lora=config.models.lora,
                       memory_options=options,
                       pps=(1,) if replay else None)


def candidate_config(config: RunConfig, candidate) -> RunConfig:
    """``config`` with ``candidate``'s placement (its ``ac_share`` and ``replan`` kept) and the
    memory options the planner priced it with."""
    placement = dataclasses.replace(candidate.config, ac_share=config.placement.ac_share,
                                    replan=config.placement.replan)
    return with_memory_options(dataclasses.replace(config, placement=placement),
                               candidate.prediction.memory.options)


def with_memory_options(config: RunConfig, options: dict[str, MemoryOptions]) -> RunConfig:
    """``config`` with the planner's offloading (``always``) and recomputation (``full``: the
    planner prices recomputing every layer) for each role it does not set itself, and
    Megatron-FSDP, or the whole optimizer shard on the host (``cpu_offload_fraction=1``), for
    each trained role the planner runs so; a shadow follows the model it copies, as in the
    engine."""
    models = config.models
    offload, recompute = dict(models.offload), dict(models.recompute)
    optimizers = {role: config.optimizer(role) for role in TRAINABLE_ROLES}
    for role, chosen in options.items():
        if role in SHADOW_OF:
            continue
        if chosen.offload:
            offload.setdefault(role, "always")
        if chosen.recompute:
            recompute.setdefault(role, "full")
        if chosen.sharding == FSDP:
            optimizers[role] = dataclasses.replace(optimizers[role], fsdp=True)
        if chosen.optimizer_offload:
            optimizers[role] = dataclasses.replace(optimizers[role], cpu_offload_fraction=1.0)
    return dataclasses.replace(
        config, models=dataclasses.replace(models, offload=offload, recompute=recompute),
        actor_optimizer=optimizers["actor"], critic_optimizer=optimizers["critic"])
