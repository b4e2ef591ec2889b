"""What a PPO step reports: training metrics combined over ranks, peak memory, and NaN/Inf found
and named.

A step's metrics are the same dict on every rank (:func:`share_metrics`, through the job's store,
so that ranks done early wait for the trainers without a collective's timeout). Each contribution
carries its reduction (``runtime/metric_reduce.py``): the losses are means weighted by tokens or
the loss's count; a stage's peak memory is the largest over the ranks that ran it
(``memory/<stage>_peak_bytes``); a trained model's learning rate is the mean over its step's
updates (``<role>/lr``, the schedule's value).
Non-finite model outputs are counted per experience field (:func:`nonfinite_experience`) and
non-finite metrics are named with the model and stage that produced them
(:func:`nonfinite_report`), then the run's ``faults.on_nan`` policy skips or stops
(:func:`apply_nan_policy`).
"""

from __future__ import annotations

import math

import torch

from megatron_rlhf.engine.execution.experience_fields import (
    SCORED,
    ExperienceFeatures,
    ExperienceFields,
    expected_fields,
)
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.runtime.faults import NonFiniteError
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.metric_reduce import (
    Max,
    Mean,
    Metric,
    Replicated,
    accumulate,
    reduce,
    values,
)
from megatron_rlhf.runtime.store_exchange import StoreExchange
from megatron_rlhf.topology.models import ACTOR, CRITIC, REWARD

logger = get_logger(__name__)

STEP_END = "step_end"
"""The store exchange of :func:`share_metrics`."""

_EXPERIENCE_SOURCES = ("old_logprobs", "ref_logprobs", "values", "rm_scores", "rule_scores")


def nonfinite_experience(fields: ExperienceFields, features: ExperienceFeatures
                         ) -> dict[str, float]:
    """``nonfinite/<field>``: count of NaN/Inf values of each model output that has any, among
    those the run's experience holds (``features``: no values without a critic)."""
    counts = {}
    held = expected_fields(features, SCORED)
    for name in _EXPERIENCE_SOURCES:
        if name not in held:
            continue
        bad = int((~torch.isfinite(fields[name])).sum())
        if bad:
            counts[f"nonfinite/{name}"] = float(bad)
    return counts


def experience_sources(engine: PPOEngine) -> dict[str, str]:
    """Which model produced each experience field and metric (the reference log-probs: the
    actor's frozen base when it trains LoRA adapters, ``PPOEngine.reference``)."""
    policy = engine.policy_for_inference
    critic = engine.critic_for_inference or "none (critic-free estimator)"
    scores = REWARD if engine.scorer == REWARD else "rule and reward functions"
    reference = (f"{engine.reference} (adapters off)" if engine.reference_is_base
                 else engine.reference)
    return {"old_logprobs": policy, "ref_logprobs": reference, "values": critic,
            "rm_scores": REWARD, "rule_scores": "rule reward", "rm_score": REWARD,
            "rule_score": "rule reward", "reward_mean": scores, "kl": f"{policy} and {reference}",
            "kl_coef": "KL controller", "values_mean": critic, "returns_mean": critic,
            "policy_loss": ACTOR, "value_loss": CRITIC}


def apply_nan_policy(metrics: dict[str, float], step: int, sources: dict[str, str],
                     on_nan: str) -> dict[str, float]:
    """Name every non-finite value of the (shared, identical) metrics; ``on_nan``: ``skip``
    (mark the step ``skipped``) or ``stop`` (raise :class:`NonFiniteError`)."""
    problems = nonfinite_report(metrics, sources)
    if not problems:
        return metrics
    message = f"step {step + 1}: " + "; ".join(problems)  # counted from 1, as the progress line
    if on_nan == "stop":
        raise NonFiniteError(f"{message}. No update was applied from these values; find the "
                             "cause (learning rate, data, reward model) or set "
                             "faults.on_nan=skip to skip such steps")
    logger.warning("%s; the step's training was skipped (faults.on_nan=skip)", message)
    return {**metrics, "skipped": 1.0}


def nonfinite_report(metrics: dict[str, float], sources: dict[str, str]) -> list[str]:
    """Descriptions of the non-finite values among step metrics, naming model and stage.

    ``nonfinite/<field>`` counts (bad model outputs) are reported instead of the experience
    metrics derived from them; ``actor/...`` and ``critic/...`` (losses, gradient norms: a skipped
    update reports a NaN norm) are the training stage.
    """
    causes = [f"{int(value)} NaN/Inf values in {key[10:]} (model {sources[key[10:]]!r}, stage "
              "'experience')" for key, value in metrics.items() if key.startswith("nonfinite/")]
    training, derived = [], []
    for key, value in metrics.items():
        if not isinstance(value, float) or math.isfinite(value) or key.startswith("nonfinite/"):
            continue
        role, _, name = key.partition("/")
        if name:
            what = "gradients" if name == "grad_norm" else name
            training.append(f"non-finite {what} (model {role!r}, stage 'training')")
        elif key not in ("policy_loss", "value_loss"):  # those copy actor/... and critic/...
            derived.append(f"{key}={value} (model {sources.get(key, '?')!r}, stage "
                           "'experience')")
    return causes + training + ([] if causes else derived)


def accumulate_train_metrics(metrics: dict[str, Metric], role: str, result: dict, worker) -> None:
    """Add this rank's contributions to one update of ``role`` (TP rank 0 of the last stage
    only, to count each row once): the loss function's metrics of every micro-batch (weighted
    means, ``training_losses``), and the update's gradient norm, learning rate and router
    metrics (the same on every rank of the replica), each logged as its mean over updates."""
    if not worker.is_output_stage or worker.pg_collection.tp.rank() != 0:
        return
    for micro in result["metrics"]:
        accumulate(metrics, {f"{role}/{name}": value for name, value in micro.items()})
    update = {"grad_norm": result["grad_norm"], "lr": result["lr"], **result.get("moe", {})}
    accumulate(metrics, {f"{role}/{name}": Mean(value) for name, value in update.items()})


def share_metrics(step_metrics: dict[str, float], train_metrics: dict[str, Metric],
                  memory_peaks: dict[str, int] | None = None,
                  exchange: StoreExchange | None = None) -> dict[str, float]:
    """Combine every rank's contributions into the same metrics dict on every rank.

    The contributions go through the job's store, not a world collective: a rank that only
    generated and scored arrives here while the trainers still train and sync weights, and waits
    for them without the process-group timeout (under NCCL, the watchdog) ending the job.

    Args:
        step_metrics: this rank's experience metrics (:class:`Replicated`: identical where
            present).
        train_metrics: this rank's training and reward-function metrics
            (:func:`accumulate_train_metrics`, ``FunctionRewards.take_extras``).
        memory_peaks: this rank's peak bytes per stage (``MemoryMeter.take``; :class:`Max`).
        exchange: the step end's exchange over every rank (default: one without fault records).
    """
    exchange = exchange if exchange is not None else StoreExchange(STEP_END)
    # Every rank: the metrics come from the ranks of every model and every rank returns all.
    gathered = exchange.all_gather_object((step_metrics, train_metrics, memory_peaks or {}))
    contributions = []
    for rank_metrics, rank_training, rank_peaks in gathered:
        contributions += [{name: Replicated(value) for name, value in rank_metrics.items()},
                          {f"memory/{stage}_peak_bytes": Max(float(peak))
                           for stage, peak in rank_peaks.items()}, rank_training]
    metrics = values(reduce(contributions))
    metrics["policy_loss"] = metrics.get("actor/pg_loss", 0.0)
    metrics["value_loss"] = metrics.get("critic/vf_loss", metrics.get("actor/vf_loss", 0.0))
    return metrics
