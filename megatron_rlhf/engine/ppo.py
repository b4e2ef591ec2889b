"""One PPO step, written in terms of models and operators (no ranks, groups or transfers).

    trainer = PPOTrainer(engine, config.algorithm, config.rollout, temperature)
    for step in range(steps):
        metrics = trainer.step(prompts, prompt_indices, step)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_rlhf.algorithms import PPOAlgorithmConfig, RunningMoments, build_kl_controller
from megatron_rlhf.engine.config import RewardConfig, RolloutConfig
from megatron_rlhf.engine.engine import PPOEngine, RuleReward
from megatron_rlhf.engine.experience import compute_advantages
from megatron_rlhf.engine.losses import actor_loss_fn, critic_loss_fn
from megatron_rlhf.topology.models import ACTOR, CRITIC


class PPOTrainer:
    """The PPO algorithm on top of a :class:`PPOEngine`.

    Args:
        engine: operators over the placed models.
        algorithm: PPO settings.
        rollout: batch shapes, epochs and mini-batches.
        reward: weights of the reward model's and the rule's scores.
        seed: seed of the mini-batch shuffling (identical on every rank).
        rule_reward: the rule-based reward, if any.
    """

    def __init__(self, engine: PPOEngine, algorithm: PPOAlgorithmConfig, rollout: RolloutConfig,
                 reward: RewardConfig, seed: int, rule_reward: RuleReward | None = None) -> None:
        self.engine = engine
        self.algorithm = algorithm
        self.rollout = rollout
        self.reward = reward
        self.seed = seed
        self.rule_reward = rule_reward
        self.kl_controller = build_kl_controller(algorithm)
        self.score_moments = RunningMoments()

    def step(self, prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
             step: int) -> dict[str, float]:
        """Generate, score, and train actor and critic on one batch of prompts.

        Returns:
            Step metrics (identical on every rank).
        """
        engine = self.engine
        temperature = engine.generation.temperature
        rollout = engine.generate_sequences(prompts, prompt_indices)
        experience = engine.make_experience(rollout, temperature, self.rule_reward)
        metrics: dict[str, float] = {}
        if experience.fields is not None:
            experience.fields, metrics = compute_advantages(
                experience.fields, self.algorithm, self.kl_controller, self.score_moments,
                self.reward.model_weight, self.reward.rule_weight)

        loss_fns = {}
        if ACTOR in engine.workers:
            loss_fns[ACTOR] = actor_loss_fn(engine.workers[ACTOR], engine.prompt_length,
                                            temperature, self.algorithm)
        if CRITIC in engine.workers:
            loss_fns[CRITIC] = critic_loss_fn(engine.workers[CRITIC], engine.prompt_length,
                                              self.algorithm)
        train_sums: dict[str, float] = {}
        for rows in self._minibatches(len(prompts), step):
            for role, loss_fn in loss_fns.items():
                result = engine.update(role, experience, rows, loss_fn)
                _accumulate(train_sums, role, result, engine.workers[role])
        engine.sync_weights()
        return _share_metrics(metrics, train_sums)

    def _minibatches(self, batch_size: int, step: int) -> list[torch.Tensor]:
        """Row indices of every mini-batch of the step: a fresh permutation per epoch."""
        size = batch_size // self.rollout.num_minibatches
        minibatches = []
        for epoch in range(self.rollout.ppo_epochs):
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(
                self.seed * 100_003 + step * 101 + epoch))
            minibatches += [order[start:start + size] for start in range(0, batch_size, size)]
        return minibatches


def _accumulate(sums: dict[str, float], role: str, result: dict, worker) -> None:
    """Add this rank's loss sums (TP rank 0 of the last stage only, to count each row once)."""
    if not worker.is_output_stage or worker.pg_collection.tp.rank() != 0:
        return
    for micro in result["metrics"]:
        for key, value in micro.items():
            sums[f"{role}/{key}"] = sums.get(f"{role}/{key}", 0.0) + float(value)
    sums[f"{role}/grad_norm_sum"] = sums.get(f"{role}/grad_norm_sum", 0.0) + result["grad_norm"]
    sums[f"{role}/steps"] = sums.get(f"{role}/steps", 0.0) + 1.0


def _share_metrics(step_metrics: dict[str, float], train_sums: dict[str, float]
                   ) -> dict[str, float]:
    """Combine every rank's contributions into the same metrics dict on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (step_metrics, train_sums))
    metrics: dict[str, float] = {}
    totals: dict[str, float] = {}
    for rank_metrics, rank_sums in gathered:
        for key, value in rank_metrics.items():
            metrics.setdefault(key, value)
        for key, value in rank_sums.items():
            totals[key] = totals.get(key, 0.0) + value
    for role in ("actor", "critic"):
        tokens = totals.get(f"{role}/tokens", 0.0)
        for key, value in totals.items():
            if key.startswith(f"{role}/") and key.endswith("_sum") and "grad_norm" not in key:
                metrics[key[:-4]] = value / tokens if tokens else 0.0
        if totals.get(f"{role}/steps"):
            replicas = totals[f"{role}/steps"]
            metrics[f"{role}/grad_norm"] = totals[f"{role}/grad_norm_sum"] / replicas
    metrics["policy_loss"] = metrics.get("actor/pg_loss", 0.0)
    metrics["value_loss"] = metrics.get("critic/vf_loss", metrics.get("actor/vf_loss", 0.0))
    return metrics
