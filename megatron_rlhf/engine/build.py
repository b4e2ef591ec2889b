"""From a ``RunConfig`` to a ready ``PPOEngine``: plan, groups, models, trainers, weight sync.

The plan is computed and validated before any process group exists, so a placement that cannot
work fails on every rank with the same message before distributed work starts.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from megatron_rlhf.engine.config import RunConfig
from megatron_rlhf.engine.engine import PPOEngine
from megatron_rlhf.engine.workers import ModelWorker
from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.trainer import ModelTrainer
from megatron_rlhf.models.weights import init_weights
from megatron_rlhf.refit import build_weight_sync
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.groups import build_process_groups
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    SHADOW_ACTOR,
    SHADOW_OF,
    TRAINABLE_ROLES,
    VALUE_HEAD_ROLES,
)
from megatron_rlhf.topology.placement import plan_placement
from megatron_rlhf.topology.plan import PlacementPlan

logger = get_logger(__name__)


def cluster_from_environment(pools: list[DevicePool] | None = None) -> ClusterSpec:
    """The configured pools, or one pool shaped like torchrun's world (nodes x local ranks)."""
    if pools:
        return ClusterSpec(tuple(pools))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return ClusterSpec((DevicePool("local", nodes=world // local, devices_per_node=local),))


def make_plan(config: RunConfig, cluster: ClusterSpec) -> PlacementPlan:
    """Validate and plan the placement (pure; raises ValueError naming the field)."""
    plan = plan_placement(cluster, config.placement, config.models.arch)
    rollout = config.rollout
    if rollout.async_rollout and not config.placement.separated:
        raise ValueError(f"rollout.async_rollout=true needs shadows to generate while the actor "
                         f"trains: set placement.strategy to separation or hetero-separation "
                         f"(not {config.placement.strategy!r})")
    chunk = rollout.prompts_per_step // rollout.pipeline_chunks
    for role in plan.roles:
        micro = rollout.micro_batch_size
        dp = plan[role].dp
        if chunk % (dp * micro):
            raise ValueError(
                f"a chunk of {chunk} prompts (rollout.prompts_per_step / pipeline_chunks) must "
                f"be a multiple of {role}'s dp({dp}) x rollout.micro_batch_size({micro})")
        minibatch = config.rollout.prompts_per_step // config.rollout.num_minibatches
        if role in TRAINABLE_ROLES and minibatch % (dp * micro):
            raise ValueError(
                f"a mini-batch of {minibatch} rows does not split into {role}'s dp({dp}) x "
                f"micro_batch_size({micro}); lower rollout.num_minibatches or micro_batch_size")
    return plan


def _head(role: str, ac_share: bool) -> str:
    if role in VALUE_HEAD_ROLES:
        return "scalar"
    return "lm+scalar" if ac_share and role in (ACTOR, SHADOW_ACTOR) else "lm"


def initial_checkpoints(config: RunConfig) -> dict[str, str]:
    """Role -> checkpoint directory its initial weights come from (roles absent: fresh init)."""
    models = config.models
    sources = {}
    if models.actor_checkpoint:
        sources.update({ACTOR: models.actor_checkpoint, REF: models.actor_checkpoint})
    if models.reward_checkpoint:
        sources[REWARD] = models.reward_checkpoint
        if models.critic_from_reward and not config.placement.ac_share:
            sources[CRITIC] = models.reward_checkpoint
    return sources


def check_checkpoint_tokenizers(config: RunConfig, tokenizer_fingerprint: str) -> None:
    """Refuse initial checkpoints trained with another tokenizer (before any process group).

    Raises:
        ValueError: naming the checkpoint, the role and the fix.
    """
    for role, directory in initial_checkpoints(config).items():
        recorded = read_checkpoint_info(directory).metadata.get("tokenizer_fingerprint")
        if recorded is not None and recorded != tokenizer_fingerprint:
            raise ValueError(
                f"{role} checkpoint {directory} was trained with another tokenizer "
                f"(fingerprint {recorded[:12]}..., this run's is {tokenizer_fingerprint[:12]}...); "
                "use the tokenizer.model saved next to that checkpoint (tokenizer.model_path)")


def build_engine(config: RunConfig, plan: PlacementPlan, eos_id: int, pad_id: int,
                 load_initial: bool = True) -> PPOEngine:
    """Build this rank's models and the engine. Collective: every rank calls it.

    Args:
        load_initial: also load the trained models' configured SFT/reward checkpoints; a
            resumed run skips those because its RL checkpoint overwrites their weights. The
            frozen reference and reward model, which no RL checkpoint holds, always load theirs.
    """
    groups = build_process_groups(
        plan, timeout=datetime.timedelta(seconds=config.runtime.distributed.timeout_s))
    rank = dist.get_rank()
    workers: dict[str, ModelWorker] = {}
    models = {}
    total_updates = (config.steps * config.rollout.ppo_epochs * config.rollout.num_minibatches)
    for role in plan.roles_on(rank):
        pgc = groups[role]
        options = ModelBuildOptions(head=_head(role, config.placement.ac_share),
                                    params_dtype=config.models.params_dtype,
                                    dropout=config.models.dropout)
        model = build_gpt_model(plan[role].spec.arch, options, pgc, seed=config.runtime.seed)
        init_weights(model, pgc, seed=config.models.init_seed)
        models[role] = model
    # Every rank takes part in each load (megatron's dist_checkpointing is collective).
    initial = {role: directory for role, directory in initial_checkpoints(config).items()
               if load_initial or role not in TRAINABLE_ROLES}
    for role, directory in initial.items():
        if role in plan.models:
            load_model_checkpoint(models.get(role), groups[role], directory, new_head=True)
    for role, model in models.items():
        trainer = None
        if role in TRAINABLE_ROLES:
            settings = config.actor_optimizer if role == ACTOR else config.critic_optimizer
            trainer = ModelTrainer(model, groups[role], settings, total_steps=total_updates)
        workers[role] = ModelWorker(role, model, groups[role], trainer,
                                    config.rollout.micro_batch_size)
    weight_syncs = {}
    for shadow, source in SHADOW_OF.items():
        if shadow in plan.models:
            src, dst = workers.get(source), workers.get(shadow)
            weight_syncs[source] = build_weight_sync(
                src.model if src else None, groups[source], plan[source],
                dst.model if dst else None, groups[shadow], plan[shadow])
    engine = PPOEngine(plan, workers, weight_syncs, config.rollout.max_prompt_length,
                       config.generation, eos_id, pad_id)
    engine.sync_weights()
    return engine
