"""The token budget of a model's forward and training micro-batches (``rollout.max_tokens_per_micro_batch: auto``).

Bigger micro-batches amortise what every forward costs beyond its matrix products (per-layer
operators, megatron's modules, the schedule) and keep the products large; packed rows carry no
padding, so a budget in real tokens is what memory limits. ``auto`` gives each model on a device
the largest budget whose activations fit what the device has left after the states of every
model placed on it, counted by the planner's memory model (``planner.cost_model``):

    free   = MEMORY_SHARE * device memory - sum of the states of the models on this device
    budget = ACTIVATION_SHARE * free / activation bytes per token

with the activation bytes per token of a training micro-batch for a trained model (its layers
under the run's recomputation, its logits and their gradient) and of a forward pass for the
others, scaled from the cost model's bf16 to the run's ``models.params_dtype``. The budget is
capped at a replica's whole step (one micro-batch then holds every row) and, under pipeline
parallelism, at a ``1 / (2 pp)`` share of it so the pipeline fills; it is never below one full row
(``max_prompt_length + max_new_tokens``; a longer row runs alone anyway). The device memory is
the GPU's, or on CPU the host's divided by the ranks on the host (``LOCAL_WORLD_SIZE``).
``docs/results/packing.md`` has the measurements behind this default.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import torch

from megatron_rlhf.config.ppo_run import TOKEN_BUDGET_AUTO, RunConfig
from megatron_rlhf.planner import RolloutSpec
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.models import TRAINABLE_ROLES, VALUE_HEAD_ROLES
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan

logger = get_logger(__name__)

MEMORY_SHARE = 0.9
"""Of the device's memory, what the run may use (the rest: the allocator's slack, the runtime)."""
ACTIVATION_SHARE = 0.5
"""Of what the states leave free, what one micro-batch's activations may take (the rest: the
KV cache of generation, transfer buffers, fragmentation)."""
BUDGET_GRANULE = 64
"""Budgets are rounded down to a multiple of this many tokens."""


def device_memory_bytes(device: torch.device) -> int:
    """Memory one rank may count on: its GPU's, or its share of the host's on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _state_bytes(model: ModelPlacement, fsdp: bool, dtype_bytes: int) -> float:
    """The planner's states of ``model`` on one device with its weights in ``dtype_bytes``
    (gradients and Adam's state are fp32 whatever the weights)."""
    spec = model.spec
    sharding = (cm.FULLY_SHARDED if fsdp else cm.DISTRIBUTED_OPTIMIZER
                if spec.distributed_optimizer else cm.REPLICATED)
    states = cm.state_bytes(spec.num_params(), model.tp, model.pp, model.dp, spec.trainable,
                            sharding, spec.arch.expert_params(), spec.ep)
    return states.weights * dtype_bytes / cm.BF16 + states.grads + states.optimizer


def activation_bytes_per_token(model: ModelPlacement, recompute: str, dtype_bytes: int) -> float:
    """Activation bytes one token of a micro-batch costs ``model`` on one of its devices: its
    layers' (the planner's bf16 count in ``dtype_bytes``; only ``full`` recomputation keeps less
    than every layer's) and the fp32 logits (with their gradient in training)."""
    arch, trainable = model.spec.arch, model.spec.trainable
    if trainable:
        layers = cm.training_activation_bytes(arch, 1, 1, model.tp, model.pp, model.pp,
                                              recompute == "full", value_head=True)
    else:
        layers = cm.forward_activation_bytes(arch, 1, 1, model.tp, value_head=True)
    logits = 0.0 if model.role in VALUE_HEAD_ROLES else cm.logits_bytes(arch, 1, model.tp,
                                                                       training=trainable)
    return layers * dtype_bytes / cm.BF16 + logits


def resolve_token_budget(config: RunConfig, plan: PlacementPlan, role: str, rank: int,
                         device: torch.device, memory_bytes: float | None = None) -> int:
    """``role``'s tokens per micro-batch on ``rank``: the configured number, or ``auto``'s (the
    module docstring) beside the models ``plan`` puts on ``rank``, on a device of
    ``memory_bytes`` (None: ``device``'s, :func:`device_memory_bytes`); 0 means fixed
    ``rollout.micro_batch_size`` rows."""
    configured = config.rollout.max_tokens_per_micro_batch
    if configured != TOKEN_BUDGET_AUTO:
        return configured
    if not config.models.packed_sequences:
        return 0
    return auto_token_budget(config, plan[role], [plan[other] for other in plan.roles_on(rank)],
                             device_memory_bytes(device) if memory_bytes is None
                             else memory_bytes)


def auto_token_budget(config: RunConfig, model: ModelPlacement,
                      colocated: Sequence[ModelPlacement], memory_bytes: float) -> int:
    """``auto``'s budget for ``model`` on a device of ``memory_bytes`` that holds the states of
    ``colocated`` (``model`` among them)."""
    dtype_bytes = torch.empty((), dtype=getattr(torch, config.models.params_dtype)).element_size()
    states = sum(_state_bytes(other, other.role in TRAINABLE_ROLES
                              and config.optimizer(other.role).fsdp, dtype_bytes)
                 for other in colocated)
    free = MEMORY_SHARE * memory_bytes - states
    per_token = activation_bytes_per_token(model, config.models.recompute_of(model.role),
                                           dtype_bytes)
    row = config.rollout.max_prompt_length + config.generation.max_new_tokens
    step = math.ceil(config.rollout.rows_per_step / model.dp) * row
    cap = step if model.pp == 1 else max(row, step // (2 * model.pp))
    fits = int(ACTIVATION_SHARE * max(free, 0.0) / per_token)
    if fits < row:
        logger.warning("%s: one row of %d tokens needs more activation memory than its device "
                       "has free after the models' states (room for %d tokens); it runs alone "
                       "and may not fit: recompute activations or raise tp/pp", model.role, row,
                       fits)
    budget = min(cap, fits)
    if budget > BUDGET_GRANULE:
        budget -= budget % BUDGET_GRANULE
    return max(budget, row)


def token_budgets(config: RunConfig, plan: PlacementPlan) -> dict[str, int]:
    """Each model's tokens per micro-batch as the run resolves them on the model's first rank,
    with that rank's pool's device memory; 0 means fixed ``rollout.micro_batch_size`` rows."""
    budgets = {}
    for role in plan.roles:
        rank = plan[role].ranks.start
        pool = plan.cluster.pools[plan.cluster.locate(rank).pool_index]
        budgets[role] = resolve_token_budget(config, plan, role, rank, torch.device("cpu"),
                                             memory_bytes=pool.memory_gib * 2**30)
    return budgets


def planner_rollout(config: RunConfig, budgets: dict[str, int] | None = None,
                    rollout: RolloutSpec | None = None) -> RolloutSpec:
    """The step's shapes for the planner, the smallest of ``budgets`` (:func:`token_budgets`;
    None: a numeric ``max_tokens_per_micro_batch`` alone) as rows.

    The planner prices every sequence at the same length (``rollout``'s priced one: by default
    the configured ``max_prompt_length + max_new_tokens``, the mean answer when it holds a length
    distribution), so a budget is priced as ``budget // sequence length`` rows (at least one);
    padded rows (no packing) are ``rollout.micro_batch_size`` rows."""
    rollout = rollout or RolloutSpec.from_run_config(config, overlap=config.rollout.async_rollout)
    budget = config.rollout.max_tokens_per_micro_batch
    if budgets is not None:
        budget = min((b for b in budgets.values() if b > 0), default=0)
    if isinstance(budget, int) and budget > 0:
        rollout = dataclasses.replace(
            rollout, micro_batch_size=max(1, budget // rollout.priced_sequence_length), packed=True)
    return rollout
