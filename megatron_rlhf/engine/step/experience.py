"""From raw experience (log-probs, values, scores) to advantages and returns.

Runs on every trainer rank over the whole experience batch, identically, so advantage whitening
(GAE, REINFORCE++), score normalisation and group baselines (GRPO, RLOO) see the full batch
whatever the placement: the engine has already gathered every row, in prompt order with the
``samples_per_prompt`` rows of a prompt contiguous, onto every trainer rank, so no further
collective is needed. Which optional fields a batch holds is the run's
:class:`ExperienceFeatures` (``engine/execution/experience_fields.py``), never a key's presence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rlhf.algorithms import (
    KLController,
    PPOAlgorithmConfig,
    RunningMoments,
    compute_token_level_rewards,
    get_advantage_estimator,
    kl_penalty,
    masked_mean,
    mean_sequence_kl,
    normalize_scores,
)
from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures, ExperienceFields
from megatron_rlhf.rewards import RewardFunctionSpec
from megatron_rlhf.rewards.overlong import OverlongPenalty


def compute_advantages(fields: ExperienceFields, config: PPOAlgorithmConfig,
                       kl_controller: KLController, score_moments: RunningMoments,
                       reward_model_weight: float, rule_weight: float,
                       samples_per_prompt: int = 1,
                       functions: Sequence[RewardFunctionSpec] = (),
                       overlong: OverlongPenalty | None = None, *,
                       features: ExperienceFeatures
                       ) -> tuple[ExperienceFields, dict[str, float]]:
    """Add ``advantages``, ``returns`` and ``kl`` to an experience batch; update the KL
    controller.

    Args:
        fields: ``old_logprobs``, ``ref_logprobs``, ``response_mask`` ``[B, R]`` and
            ``rule_scores`` ``[B]``; with ``features.critic`` ``values`` ``[B, R]``, with
            ``features.reward_model`` ``rm_scores`` ``[B]``, with ``features.episodes``
            ``episode_reward`` ``[B]``, and with ``functions`` ``function_scores`` ``[B, k]``
            and ``reward_errors`` ``[B]``; the whole batch, groups of ``samples_per_prompt``
            rows contiguous.
        config: PPO settings.
        kl_controller: its current coefficient weighs the KL penalty; it is then updated with
            this batch's KL.
        score_moments: running score statistics (used with ``reward_norm="running"``).
        reward_model_weight: weight of the reward model's score in the sequence score.
        rule_weight: weight of the rule-based score.
        samples_per_prompt: rows per group (grpo, rloo).
        functions: the reward functions, whose weighted scores are added to the sequence score
            and whose batch means are logged as ``reward/<function>``, with ``reward/errors``
            the failed calls.
        overlong: DAPO's overlong penalty by generated tokens, added to the sequence score and
            logged as ``reward/overlong``; None: none.
        features: which optional fields the run's experience holds.

    Returns:
        The fields with ``advantages``, ``returns`` and ``kl`` added, and step metrics.
    """
    mask = fields["response_mask"]
    kl = kl_penalty(fields["old_logprobs"], fields["ref_logprobs"], mask, config.kl_estimator)
    raw_scores = sequence_scores(fields, reward_model_weight, rule_weight, functions, overlong,
                                 features=features)
    function_metrics = {}
    if overlong is not None:
        function_metrics["reward/overlong"] = overlong(mask).mean().item()
    if functions:
        function_scores = fields["function_scores"]
        function_metrics.update({spec.metric: function_scores[:, i].mean().item()
                                 for i, spec in enumerate(functions)})
        function_metrics["reward/errors"] = fields["reward_errors"].sum().item()
    scores = normalize_scores(raw_scores, config.reward_norm, score_moments)
    kl_coef = kl_controller.value
    rewards = compute_token_level_rewards(scores, kl, mask, kl_coef, config.reward_clip)
    sequence_kl = mean_sequence_kl(kl, mask).item()
    kl_controller.update(sequence_kl, n_steps=mask.shape[0])
    values = fields["values"] if features.critic else None
    advantages, returns = _advantages(rewards, mask, values, config, samples_per_prompt)
    metrics = {
        "reward_mean": raw_scores.mean().item(),
        "rule_score": fields["rule_scores"].mean().item(),
        "kl": sequence_kl,
        "kl_coef": kl_coef,
        "response_length": mask.sum(dim=1).float().mean().item(),
        # A generation round lasts as long as its longest answer (a long tail of lengths).
        "response_length_max": mask.sum(dim=1).float().max().item(),
        "returns_mean": masked_mean(returns, mask).item(),
        **function_metrics,
    }
    if features.reward_model:
        metrics["rm_score"] = fields["rm_scores"].mean().item()
    if values is not None:
        metrics["values_mean"] = masked_mean(values, mask).item()
    return {**fields, "advantages": advantages, "returns": returns, "kl": kl}, metrics


def rollout_metrics(fields: ExperienceFields) -> dict[str, float]:
    """``prompt_length`` (real prompt tokens per row, mean: the step's throughput counts them)
    and the generation/trainer agreement (:func:`rollout_agreement`) of a step's batch."""
    mask = fields["response_mask"]
    return {"prompt_length": (fields["attention_mask"].sum(dim=1)
                              - mask.sum(dim=1)).float().mean().item(),
            **rollout_agreement(fields["gen_logprobs"], fields["old_logprobs"], mask)}


def rollout_agreement(gen_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """How far the generating model's log-probs of its own tokens are from the trainer's forward
    of the same tokens (``[B, R]`` each, response tokens only): ``rollout/logprob_diff_max`` and
    ``_mean`` of the absolute difference. Both models hold the same weights, so on CPU in fp32
    it is rounding (~1e-6); in bf16 on GPUs, and after a refit into another layout, it is the
    first number to read when PPO's ratio drifts at step 0."""
    gap = (gen_logprobs - old_logprobs).abs() * mask
    return {"rollout/logprob_diff_max": gap.max().item(),
            "rollout/logprob_diff_mean": masked_mean(gap, mask).item()}


def sequence_scores(fields: ExperienceFields, reward_model_weight: float,
                    rule_weight: float, functions: Sequence[RewardFunctionSpec] = (),
                    overlong: OverlongPenalty | None = None, *,
                    features: ExperienceFeatures) -> torch.Tensor:
    """Each row's weighted score ``[B]`` before normalisation and KL: the reward model's (with
    ``features.reward_model``), the rule's and the reward functions', plus the overlong penalty
    and an episode's summed environment rewards (``features.episodes``)."""
    scores = rule_weight * fields["rule_scores"]
    if features.reward_model:
        scores = reward_model_weight * fields["rm_scores"] + scores
    if functions:
        function_scores = fields["function_scores"]
        weights = torch.tensor([spec.weight for spec in functions]).to(function_scores)
        scores = scores + (function_scores * weights).sum(dim=-1)
    if overlong is not None:
        scores = scores + overlong(fields["response_mask"]).to(scores)
    if features.episodes:  # an environment's step rewards, summed per episode (0: tools)
        scores = scores + fields["episode_reward"].to(scores)
    return scores


def _advantages(rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None,
                config: PPOAlgorithmConfig, samples_per_prompt: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, R]`` of the configured estimator (its entry in
    ``ADVANTAGE_ESTIMATORS``) from token rewards; ``values`` the critic's (None: no critic)."""
    estimator = get_advantage_estimator(config.advantage_estimator)
    return estimator.compute(rewards, mask, config, values=values,
                             group_size=samples_per_prompt)
