"""Loss functions of the training stage in megatron's per-token form.

megatron's schedule takes ``(loss_sum, count, metrics)`` per micro-batch and divides the
gradients by the count summed over the whole step, so a loss is passed as ``value * count`` with
``count = aggregation_denominator(mask, algorithm.loss_aggregation)``: the response tokens for
``token_mean`` (PPO's default), the rows with a response for the ``seq_mean_*`` modes. That
reproduces the mini-batch's aggregate whatever the micro-batching. Metrics are weighted means
(``runtime.metric_reduce.Mean``), reduced across micro-batches and ranks by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rlhf.algorithms import (
    PPOAlgorithmConfig,
    aggregation_denominator,
    compute_entropy_loss,
    compute_kl_loss,
    compute_value_loss,
    get_off_policy,
    get_policy_loss,
)
from megatron_rlhf.engine.execution.workers import ModelWorker
from megatron_rlhf.models.gpt import split_policy_value
from megatron_rlhf.models.logprobs import next_token_nll
from megatron_rlhf.runtime.metric_reduce import Mean

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple]


AGGREGATED_METRICS = ("pg_loss", "kl_loss")
"""Metrics that are a loss under ``algorithm.loss_aggregation``: weighted by that aggregation's
count, so the step's value does not depend on the micro-batching (under ``seq_mean_*`` a
micro-batch's loss is a mean over its rows, not its tokens)."""


def _step_metrics(tokens: torch.Tensor, metrics: dict[str, torch.Tensor],
                  count: torch.Tensor | None = None) -> dict[str, Mean]:
    """Each micro-batch metric as a :class:`Mean` weighted by ``tokens``, or for
    ``AGGREGATED_METRICS`` by the loss's ``count``: the step reports the weighted mean over its
    micro-batches and ranks (``step_metrics.share_metrics``)."""
    weighted = {}
    for key, value in metrics.items():
        weight = count if count is not None and key in AGGREGATED_METRICS else tokens
        weighted[key] = Mean(value.detach() * weight, weight)
    return weighted


def actor_loss_fn(worker: ModelWorker, prompt_length: int, temperature: float,
                  config: PPOAlgorithmConfig) -> LossFn:
    """Policy loss (``algorithm.policy_loss``) + entropy bonus (+ value loss with a shared trunk,
    AC-Share; + KL loss to the reference, from the batch's ``ref_logprobs``, when
    ``kl_in="loss"``). The ratio is taken against, and the per-token losses weighted by, what
    ``algorithm.off_policy`` says (``algorithms/off_policy.py``): with ``none`` against the
    batch's ``old_logprobs``; otherwise (a correction that ``needs_proximal``) against its
    ``proximal_logprobs``, weighted by their importance against the behaviour's
    ``gen_logprobs``.

    A micro-batch of PPO-ptx demonstrations (it has a ``loss_mask``) contributes its summed
    response NLL times its ``ptx_weight`` and no count (``PPOAlgorithm._supervised_rows``).
    """
    token_mean = config.loss_aggregation == "token_mean"
    policy_loss = get_policy_loss(config.policy_loss).compute
    correction = get_off_policy(config.off_policy)
    off_policy = correction.compute

    def loss_fn(output: torch.Tensor, batch: dict[str, torch.Tensor]):
        if "loss_mask" in batch:
            logits = split_policy_value(output)[0] if worker.head == "lm+scalar" else output
            nll_sum, tokens = next_token_nll(logits, batch["input_ids"], batch["loss_mask"],
                                             worker.pg_collection.tp,
                                             worker.model.token_vocab_size)
            no_count = torch.zeros((), dtype=torch.int, device=output.device)
            return (nll_sum * batch["ptx_weight"][0], no_count,
                    {"ptx_nll": Mean(nll_sum.detach(), tokens)})
        mask = batch["response_mask"]
        tokens = mask.sum()
        count = tokens if token_mean else aggregation_denominator(mask, config.loss_aggregation)
        logprobs, entropy = worker.token_logprobs(output, batch, prompt_length, temperature,
                                                  with_entropy=config.entropy_coef > 0)
        behaviour, proximal = ((batch["gen_logprobs"], batch["proximal_logprobs"])
                                if correction.needs_proximal else (None, None))
        anchor, weights = off_policy(batch["old_logprobs"], behaviour, proximal, mask, config)
        # A loss registered without ``token_weights`` still serves off_policy=none.
        weighted = {} if weights is None else {"token_weights": weights}
        loss, metrics = policy_loss(logprobs, anchor, batch["advantages"], mask, config,
                                    **weighted)
        if config.kl_in == "loss":
            kl_loss, kl_metrics = compute_kl_loss(logprobs, batch["ref_logprobs"], mask,
                                                  config.kl_loss_estimator,
                                                  config.loss_aggregation)
            loss = loss + config.kl_loss_coef * kl_loss
            metrics.update(kl_metrics)
        if entropy is not None:
            entropy_loss, entropy_metrics = compute_entropy_loss(entropy, mask, config.entropy_coef,
                                                                 config.loss_aggregation)
            loss = loss + entropy_loss
            metrics.update(entropy_metrics)
        if worker.head == "lm+scalar":
            values = worker.token_values(output, prompt_length)
            value_loss, value_metrics = compute_value_loss(
                values, batch["values"], batch["returns"], mask, config.value_clip,
                config.loss_aggregation)
            loss = loss + config.value_loss_coef * value_loss
            metrics.update(value_metrics)
        return loss * count, count.int(), _step_metrics(tokens, metrics, count)

    return loss_fn


def critic_loss_fn(worker: ModelWorker, prompt_length: int, config: PPOAlgorithmConfig) -> LossFn:
    """Clipped value loss."""
    def loss_fn(output: torch.Tensor, batch: dict[str, torch.Tensor]):
        mask = batch["response_mask"]
        tokens = mask.sum()
        values = worker.token_values(output, prompt_length)
        loss, metrics = compute_value_loss(values, batch["values"], batch["returns"], mask,
                                           config.value_clip)
        return loss * tokens, tokens.int(), _step_metrics(tokens, metrics)

    return loss_fn
