"""From a ``RunConfig`` to a ready ``PPOEngine``: plan, groups, models, trainers, weight sync.

The plan is computed and validated before any process group exists, so a placement that cannot
work fails on every rank with the same message before distributed work starts.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from megatron_rlhf.builder.networks import build_model
from megatron_rlhf.builder.sources import (
    ModelSource,
    decoding_roles,
    load_initial_weights,
    resolve_sources,
    role_architectures,
    role_options,
)
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.execution.episodes import EpisodeRollouts
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.engine.execution.throughput import WorkMeter, device_peak_flops
from megatron_rlhf.engine.execution.workers import ModelWorker
from megatron_rlhf.engine.run.micro_batching import resolve_token_budget
from megatron_rlhf.engine.run.stage_memory import (
    decode_graph_roles,
    decode_positions,
    graphs_captured,
    offload_policies,
)
from megatron_rlhf.models.checkpoint import read_checkpoint_info
from megatron_rlhf.models.hf_tokenizer import HFTokenizer, is_hf_tokenizer_dir
from megatron_rlhf.models.lora import apply_lora, check_no_adapters, trained_with_adapters
from megatron_rlhf.models.peft_export import load_peft_adapter
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.models.trainer import ModelTrainer
from megatron_rlhf.refit import build_weight_sync
from megatron_rlhf.refit.sync import FirstFullSync
from megatron_rlhf.runtime.context import RunContext
from megatron_rlhf.runtime.device import compute_device
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.groups import build_process_groups
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    SHADOW_OF,
    TRAINABLE_ROLES,
    resolve_arch,
)
from megatron_rlhf.topology.placement import plan_placement
from megatron_rlhf.topology.plan import PlacementPlan

logger = get_logger(__name__)


def make_plan(config: RunConfig, cluster: ClusterSpec,
              sources: dict[str, ModelSource] | None = None) -> PlacementPlan:
    """Validate and plan the placement (pure; raises ValueError naming the field).

    Args:
        sources: the initial checkpoints (:func:`resolve_sources`), whose architectures replace
            the ``models.arch`` preset.
    """
    archs = role_architectures(config, sources or {})
    plan = plan_placement(cluster, config.placement, archs,
                          adapters=config.models.lora.role_adapters(archs))
    rollout = config.rollout
    if rollout.async_rollout and not config.placement.separated:
        raise ValueError(f"rollout.async_rollout=true needs shadows to generate while the actor "
                         f"trains: set placement.strategy to separation or hetero-separation "
                         f"(not {config.placement.strategy!r})")
    for role in TRAINABLE_ROLES:
        placed = plan.models.get(role)
        if config.optimizer(role).fsdp and placed and (placed.pp != 1 or placed.size != cluster.world_size):
            raise ValueError(
                f"{role}_optimizer.fsdp=true needs the {role} on all {cluster.world_size} ranks "
                f"with pp=1 (megatron-core 0.16.1's FSDP adapter meshes the whole world); this "
                f"placement gives it {placed.size} ranks with pp={placed.pp}: use "
                "placement.strategy=flattening and pp=1")
    chunk = rollout.rows_per_step // rollout.pipeline_chunks
    micro = rollout.micro_batch_size
    unsplit = _unsplit_role(plan, chunk, micro)
    if unsplit is not None:
        raise ValueError(
            f"a chunk of {chunk} rows (rollout.prompts_per_step x samples_per_prompt / "
            f"pipeline_chunks) must be a multiple of {unsplit}'s dp({plan[unsplit].dp}) x "
            f"rollout.micro_batch_size({micro})")
    minibatch = rollout.rows_per_step // rollout.num_minibatches
    unsplit = _unsplit_role(plan, minibatch, micro,
                            [role for role in plan.roles if role in TRAINABLE_ROLES])
    if unsplit is not None:
        raise ValueError(
            f"a mini-batch of {minibatch} rows does not split into {unsplit}'s "
            f"dp({plan[unsplit].dp}) x micro_batch_size({micro}); lower "
            "rollout.num_minibatches or micro_batch_size")
    if config.ptx.enabled and ACTOR in plan.models and _unsplit_role(plan, config.ptx_rows, micro,
                                                                     [ACTOR]):
        raise ValueError(
            f"{config.ptx_rows} supervised rows per update (ptx.rows, or the PPO mini-batch's) "
            f"do not split into the actor's dp({plan[ACTOR].dp}) x micro_batch_size({micro}); "
            f"set ptx.rows to a multiple of {plan[ACTOR].dp * micro}")
    return plan


def _unsplit_role(plan: PlacementPlan, rows: int, micro_batch_size: int,
                  roles: Sequence[str] | None = None) -> str | None:
    """The first of ``roles`` (default: every placed role) whose DP replicas cannot take
    ``rows`` in whole micro-batches."""
    return next((role for role in (plan.roles if roles is None else roles)
                 if rows % (plan[role].dp * micro_batch_size)), None)


def check_evaluation_size(plan: PlacementPlan, config: RunConfig, num_prompts: int) -> None:
    """Refuse a held-out set that the models cannot split into whole micro-batches (every
    model runs the evaluation's answers as one batch), before any process group exists.

    Raises:
        ValueError: naming evaluation.num_prompts and the nearest sizes that split.
    """
    micro = config.rollout.micro_batch_size
    unsplit = _unsplit_role(plan, num_prompts, micro)
    if unsplit is None:
        return
    multiple = math.lcm(*(plan[role].dp * micro for role in plan.roles))
    lower = num_prompts // multiple * multiple
    fix = f"evaluation.num_prompts={lower}" if lower else f"at least {multiple} held-out prompts"
    raise ValueError(
        f"{num_prompts} held-out prompts (evaluation.num_prompts, or fewer in "
        f"evaluation.paths) must be a multiple of {unsplit}'s dp({plan[unsplit].dp}) x "
        f"rollout.micro_batch_size({micro}); every model's multiple is {multiple}: use {fix}")


def check_checkpoint_tokenizers(sources: dict[str, ModelSource],
                                tokenizer: Tokenizer | HFTokenizer) -> None:
    """Refuse initial checkpoints made with another tokenizer (before any process group): a
    megatron_rlhf checkpoint's recorded fingerprint, a Hugging Face directory's own tokenizer, and
    a vocabulary larger than a model's embedding.

    Raises:
        ValueError: naming the checkpoint, the role and the fix.
    """
    for role, source in sources.items():
        embedded = source.description.arch.vocab_size
        if tokenizer.vocab_size > embedded:
            raise ValueError(f"{role} checkpoint {source.path} embeds {embedded} tokens but the "
                             f"tokenizer {tokenizer.source} has {tokenizer.vocab_size}; use the "
                             "checkpoint's own tokenizer")
        if source.is_hf:
            if not is_hf_tokenizer_dir(source.path):
                logger.warning("%s checkpoint %s ships no tokenizer.json: nothing shows it was "
                               "trained with this run's tokenizer %s; copy its tokenizer there "
                               "to have it checked", role, source.path, tokenizer.source)
                continue
            recorded = HFTokenizer.load(source.path).fingerprint
        else:
            recorded = read_checkpoint_info(source.path).metadata.get("tokenizer_fingerprint")
        if recorded is not None and recorded != tokenizer.fingerprint:
            raise ValueError(
                f"{role} checkpoint {source.path} was made with another tokenizer (fingerprint "
                f"{recorded[:12]}..., this run's {tokenizer.source} is "
                f"{tokenizer.fingerprint[:12]}...); use the tokenizer saved with that checkpoint "
                "(tokenizer.hf_dir for a Hugging Face directory, tokenizer.model_path otherwise)")


_TRAINED_BESIDE_ADAPTERS = {CRITIC: ("output_layer",)}
"""What trains in full beside a role's adapters: a critic's new value head."""
_SOURCE_FIELDS = {ACTOR: "models.actor_checkpoint", REF: "models.actor_checkpoint",
                  CRITIC: "models.reward_checkpoint", REWARD: "models.reward_checkpoint"}
"""The setting that names each role's starting checkpoint, for messages."""


def build_engine(config: RunConfig, plan: PlacementPlan, eos_id: int | tuple[int, ...],
                 pad_id: int, load_initial: bool = True,
                 sources: dict[str, ModelSource] | None = None,
                 context: RunContext | None = None, token_vocab_size: int = 0,
                 episodes: EpisodeRollouts | None = None) -> PPOEngine:
    """Build this rank's models and the engine. Collective: every rank calls it.

    Args:
        load_initial: also load the trained models' configured SFT/reward checkpoints; a
            resumed run skips those because its RL checkpoint overwrites their weights. The
            frozen reference and reward model, which no RL checkpoint holds, always load theirs.
        sources: the initial checkpoints (default: read from the configuration).
        context: the run's tracer and fault tracker, given to the engine (default: none).
        token_vocab_size: the tokenizer's ids, when the models embed more rows (see
            ``ModelBuildOptions.token_vocab_size``); 0: every row.
        episodes: multi-turn rollouts with tools (``rollout.tools``); the engine's response
            width is then ``rollout.max_episode_tokens``.
    """
    sources = resolve_sources(config) if sources is None else sources
    for role, source in sources.items():
        if not source.is_hf:
            check_no_adapters(source.path, _SOURCE_FIELDS.get(role, f"the {role}'s checkpoint"))
    groups = build_process_groups(
        plan, timeout=datetime.timedelta(seconds=config.runtime.distributed.timeout_s))
    rank = dist.get_rank()
    workers: dict[str, ModelWorker] = {}
    models = {}
    total_updates = (config.steps * config.rollout.ppo_epochs * config.rollout.num_minibatches)
    decoding, layers = decoding_roles(config, plan), {}
    for role in plan.roles_on(rank):
        pgc = groups[role]
        options = replace(role_options(config, sources, SHADOW_OF.get(role, role),
                                       decodes=role in decoding),
                          recompute=config.models.recompute_of(role),
                          token_vocab_size=token_vocab_size)
        if config.models.lora.applies_to(SHADOW_OF.get(role, role)):  # on the local layers
            options = replace(options, transformer_impl="local")
        models[role] = build_model(plan[role].spec.arch, options, pgc,
                                   runtime_seed=config.runtime.seed,
                                   init_seed=config.models.init_seed)
        layers[role] = options.transformer_impl
    logger.info("layers: %s", ", ".join(f"{role} {impl}" for role, impl in layers.items()))
    _log_reference(config, plan)
    initial = {role: source for role, source in sources.items()
               if load_initial or role not in TRAINABLE_ROLES}
    load_initial_weights(models, groups, plan.models, initial, config.models.hf_cache_dir)
    for role, model in models.items():
        if config.models.lora.applies_to(SHADOW_OF.get(role, role)):
            # a critic's new value head trains in full beside its adapters; a shadow keeps
            # the same adapters, which its syncs then copy
            apply_lora(model, config.models.lora,
                       trainable=_TRAINED_BESIDE_ADAPTERS.get(role, ()))
            if role == ACTOR and config.models.lora.init_adapter_dir and load_initial:
                load_peft_adapter(model, groups[role], plan[role].spec.arch, config.models.lora)
    graphs = graphs_captured(config, compute_device())
    offload = offload_policies(config, plan, graphs)
    keeps_graphs = decode_graph_roles(plan, offload, graphs)
    work = WorkMeter(device_peak_flops(compute_device(),
                                       getattr(torch, config.models.params_dtype)))
    for role, model in models.items():
        trainer = None
        if role in TRAINABLE_ROLES:
            trainer = ModelTrainer(model, groups[role], config.optimizer(role),
                                   total_steps=total_updates)
        workers[role] = ModelWorker(role, model, groups[role], trainer,
                                    config.rollout.micro_batch_size,
                                    offload=offload[role],
                                    meter=context.memory if context else None,
                                    max_tokens_per_micro_batch=resolve_token_budget(
                                        config, plan, role, rank, compute_device()),
                                    work=work, keep_graphs=role in keeps_graphs,
                                    generation_length=decode_positions(config))
    logger.info("tokens per micro-batch: %s", ", ".join(
        f"{role} {worker.max_tokens_per_micro_batch or 'fixed rows'}"
        for role, worker in workers.items()))
    weight_syncs = {}
    for shadow, source in SHADOW_OF.items():
        if shadow in plan.models:
            src, dst = workers.get(source), workers.get(shadow)
            pair = (src.model if src else None, groups[source], plan[source],
                    dst.model if dst else None, groups[shadow], plan[shadow])
            settings = {"timeout_s": config.runtime.transfer_timeout_s,
                        "verify": config.refit.verify}
            weight_syncs[source] = build_weight_sync(*pair, **settings)
            if config.models.lora.applies_to(source):  # the frozen base moves once
                weight_syncs[source] = FirstFullSync(
                    weight_syncs[source],
                    build_weight_sync(*pair, **settings, only=partial(
                        trained_with_adapters, trainable=_TRAINED_BESIDE_ADAPTERS.get(source, ()))))
    generation = config.generation
    if episodes is not None:
        generation = replace(generation, max_new_tokens=config.rollout.max_episode_tokens)
    engine = PPOEngine(plan, workers, weight_syncs, config.rollout.max_prompt_length,
                       generation, eos_id, pad_id, context,
                       reuse_generation_logprobs=config.rollout.reuse_generation_logprobs,
                       transfer_timeout_s=config.runtime.transfer_timeout_s, episodes=episodes,
                       replayed_routes=_replayed_routes(config),
                       reference_is_base=config.models.lora.applies_to(ACTOR),
                       partial_rollouts=config.rollout.partial_rollouts)
    engine.sync_weights()
    return engine


def _log_reference(config: RunConfig, plan: PlacementPlan) -> None:
    """Say where the reference log-probs come from when no reference model is placed, and that
    the placement's ref ratio then goes unused."""
    if REF in plan.models:
        return
    ratio = config.placement.role_ratios().get(REF)
    unused = "" if ratio is None else f"; its placement ratio {ratio:g} is unused"
    logger.info("reference log-probs: the actor's base with its LoRA adapters off (models.lora); "
                "no reference model is placed or built%s", unused)


def _replayed_routes(config: RunConfig) -> tuple[int, int] | None:
    """``(layers, topk)`` of the policy's routes when ``models.moe.router_replay`` replays them
    (the old log-probs are then computed by a forward, not reused from generation)."""
    moe = config.models.moe
    if not moe.enabled or not moe.router_replay or config.rollout.reuse_generation_logprobs:
        return None
    return resolve_arch(config.models.arch).num_layers, moe.topk
