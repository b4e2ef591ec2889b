"""Loss functions of the training stage in megatron's per-token form.

megatron's schedule takes ``(loss_sum, num_tokens, metrics)`` per micro-batch and divides the
gradients by the tokens of the whole step, so the PPO losses (token means over a mini-batch) are
passed as ``mean * tokens``. Metrics are sums too, reduced across ranks by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rlhf.algorithms import (
    PPOAlgorithmConfig,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
)
from megatron_rlhf.engine.workers import ModelWorker

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple]


def _as_sums(tokens: torch.Tensor, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**{f"{k}_sum": v.detach() * tokens for k, v in metrics.items()}, "tokens": tokens}


def actor_loss_fn(worker: ModelWorker, prompt_length: int, temperature: float,
                  config: PPOAlgorithmConfig) -> LossFn:
    """Clipped policy loss + entropy bonus (+ value loss with a shared trunk, AC-Share)."""
    def loss_fn(output: torch.Tensor, batch: dict[str, torch.Tensor]):
        mask = batch["response_mask"]
        tokens = mask.sum()
        logprobs, entropy = worker.token_logprobs(output, batch, prompt_length, temperature,
                                                  with_entropy=config.entropy_coef > 0)
        loss, metrics = compute_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                                            mask, config.clip_ratio, config.dual_clip)
        if entropy is not None:
            entropy_loss, entropy_metrics = compute_entropy_loss(entropy, mask, config.entropy_coef)
            loss = loss + entropy_loss
            metrics.update(entropy_metrics)
        if worker.head == "lm+scalar":
            values = worker.token_values(output, prompt_length)
            value_loss, value_metrics = compute_value_loss(
                values, batch["values"], batch["returns"], mask, config.value_clip)
            loss = loss + config.value_loss_coef * value_loss
            metrics.update(value_metrics)
        return loss * tokens, tokens.int(), _as_sums(tokens, metrics)

    return loss_fn


def critic_loss_fn(worker: ModelWorker, prompt_length: int, config: PPOAlgorithmConfig) -> LossFn:
    """Clipped value loss."""
    def loss_fn(output: torch.Tensor, batch: dict[str, torch.Tensor]):
        mask = batch["response_mask"]
        tokens = mask.sum()
        values = worker.token_values(output, prompt_length)
        loss, metrics = compute_value_loss(values, batch["values"], batch["returns"], mask,
                                           config.value_clip)
        return loss * tokens, tokens.int(), _as_sums(tokens, metrics)

    return loss_fn
