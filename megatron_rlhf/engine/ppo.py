"""The PPO algorithm, written in terms of models and operators (no ranks, groups or transfers).

    trainer = PPOTrainer(engine, config.algorithm, config.rollout, config.reward, seed,
                         prompts=prompt_stream.batch)
    for step in range(steps):
        metrics = trainer.step(step)

A step *produces* experience (generate, score, advantages) and *consumes* it (train actor and
critic, then sync the shadows). Synchronously, step k consumes what it just produced. In the
asynchronous mode (separation), step k trains on experience produced ``max_staleness`` steps
earlier while the shadows already generate step ``k + max_staleness``: the trainable models and
the shadows hold disjoint ranks, so the two halves run at the same time. The behaviour log-probs
recorded by the shadow are the ones PPO's importance ratio uses, so the update stays correct
off-policy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.algorithms import PPOAlgorithmConfig, RunningMoments, build_kl_controller
from megatron_rlhf.engine.batch import DistBatch, concat
from megatron_rlhf.engine.config import RewardConfig, RolloutConfig
from megatron_rlhf.engine.engine import PPOEngine, RuleReward
from megatron_rlhf.engine.experience import compute_advantages
from megatron_rlhf.engine.losses import actor_loss_fn, critic_loss_fn
from megatron_rlhf.runtime.faults import NonFiniteError
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.models import ACTOR, CRITIC, REF, REWARD

logger = get_logger(__name__)

PromptSource = Callable[[int], tuple[Sequence[Sequence[int]], Sequence[int]]]
"""step -> (prompts, their sample ids)."""


@dataclass
class Experience:
    """One step's experience on the trainer ranks, with the metrics of producing it."""

    step: int
    batch: DistBatch
    metrics: dict[str, float]


class PPOTrainer:
    """The PPO algorithm on top of a :class:`PPOEngine`.

    Args:
        engine: operators over the placed models; its ``context`` also records this trainer's
            spans.
        algorithm: PPO settings.
        rollout: batch shapes, epochs, mini-batches, pipelining and asynchrony.
        reward: weights of the reward model's and the rule's scores.
        seed: seed of the mini-batch shuffling (identical on every rank).
        prompts: the prompts of each step.
        total_steps: steps of the run; nothing is produced for steps at or past it.
        rule_reward: the rule-based reward, if any.
        on_nan: NaN/Inf in experience, losses or gradients: ``skip`` (no update from it; the
            step's metrics get ``skipped=1``) or ``stop`` (raise :class:`NonFiniteError` on every
            rank after the step, which applied no update from the bad values either).
    """

    def __init__(self, engine: PPOEngine, algorithm: PPOAlgorithmConfig, rollout: RolloutConfig,
                 reward: RewardConfig, seed: int, prompts: PromptSource, total_steps: int,
                 rule_reward: RuleReward | None = None, on_nan: str = "stop") -> None:
        self.engine = engine
        self.algorithm = algorithm
        self.rollout = rollout
        self.reward = reward
        self.seed = seed
        self.prompts = prompts
        self.total_steps = total_steps
        self.rule_reward = rule_reward
        self.on_nan = on_nan
        self.kl_controller = build_kl_controller(algorithm)
        self.score_moments = RunningMoments()
        self._queue: deque[Experience] = deque()

    @property
    def staleness(self) -> int:
        """Steps between producing experience and training on it (0: synchronous)."""
        return self.rollout.max_staleness if self.rollout.async_rollout else 0

    def step(self, step: int) -> dict[str, float]:
        """Run PPO step ``step``; returns its metrics (identical on every rank)."""
        if not self._queue:
            # Synchronous steps, or the first asynchronous one: produce what is trained on now
            # and what the shadows run ahead with.
            for ahead in range(max(1, self.staleness)):
                if step + ahead < self.total_steps:
                    self._queue.append(self.produce(step + ahead))
        experience = self._queue.popleft()
        train_sums = self.consume(experience)
        if self.staleness and step + self.staleness < self.total_steps:
            # Shadows generate ahead while the trainers above were busy; then both meet here.
            self._queue.append(self.produce(step + self.staleness))
        with self.engine.context.span("sync_weights"):
            self.engine.sync_weights()
        return self._apply_nan_policy(_share_metrics(experience.metrics, train_sums), step)

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's own state: KL controller and running score moments.

        Experience produced ahead (asynchronous mode) is not included: a resumed run produces it
        again with the resumed weights.
        """
        return {"kl_controller": self.kl_controller.state_dict(),
                "score_moments": self.score_moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.score_moments.load_state_dict(state["score_moments"])

    @property
    def experience_in_flight(self) -> int:
        """Steps of experience produced ahead and not yet trained on."""
        return len(self._queue)

    def produce(self, step: int) -> Experience:
        """Generate and score step ``step``'s prompts; advantages on the trainer ranks.

        The prompts go through in ``rollout.pipeline_chunks`` chunks: a generating rank starts on
        chunk ``i + 1`` while the experience models score chunk ``i``.
        """
        engine = self.engine
        prompts, ids = self.prompts(step)
        size = len(prompts) // self.rollout.pipeline_chunks
        parts = []
        for chunk, start in enumerate(range(0, len(prompts), size)):
            rollout = engine.generate_sequences(prompts[start:start + size],
                                                ids[start:start + size], chunk)
            parts.append(engine.make_experience(rollout, engine.generation.temperature,
                                                self.rule_reward, chunk))
        engine.finish_transfers()
        batch = concat(parts)
        metrics: dict[str, float] = {}
        if batch.fields is not None:
            before = self.state_dict()
            with self.engine.context.span("advantages"):
                batch.fields, metrics = compute_advantages(
                    batch.fields, self.algorithm, self.kl_controller, self.score_moments,
                    self.reward.model_weight, self.reward.rule_weight)
            bad = self._nonfinite_experience(batch.fields)
            if bad:
                self.load_state_dict(before)  # the KL controller must not learn from NaNs
                metrics.update(bad)
        return Experience(step, batch, metrics)

    def _nonfinite_experience(self, fields: dict[str, torch.Tensor]) -> dict[str, float]:
        """``nonfinite/<field>``: count of NaN/Inf values of each model output that has any."""
        counts = {}
        for name in _EXPERIENCE_SOURCES:
            bad = int((~torch.isfinite(fields[name])).sum())
            if bad:
                counts[f"nonfinite/{name}"] = float(bad)
        return counts

    def _sources(self) -> dict[str, str]:
        """Which model produced each experience field and metric."""
        policy, critic = self.engine.policy_for_inference, self.engine.critic_for_inference
        return {"old_logprobs": policy, "ref_logprobs": REF, "values": critic,
                "rm_scores": REWARD, "rule_scores": "rule reward", "rm_score": REWARD,
                "rule_score": "rule reward", "reward_mean": REWARD, "kl": f"{policy} and {REF}",
                "kl_coef": "KL controller", "values_mean": critic, "returns_mean": critic,
                "policy_loss": ACTOR, "value_loss": CRITIC}

    def _apply_nan_policy(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Name every non-finite value of the (shared, identical) metrics; skip or stop."""
        problems = nonfinite_report(metrics, self._sources())
        if not problems:
            return metrics
        message = f"step {step}: " + "; ".join(problems)
        if self.on_nan == "stop":
            raise NonFiniteError(f"{message}. No update was applied from these values; find the "
                                 "cause (learning rate, data, reward model) or set "
                                 "faults.on_nan=skip to skip such steps")
        logger.warning("%s; the step's training was skipped (faults.on_nan=skip)", message)
        return {**metrics, "skipped": 1.0}

    def consume(self, experience: Experience) -> dict[str, float]:
        """Train actor and critic on an experience batch; returns this rank's loss sums.

        Experience with NaN/Inf model outputs is not trained on.
        """
        engine = self.engine
        if any(key.startswith("nonfinite/") for key in experience.metrics):
            return {}
        temperature = engine.generation.temperature
        loss_fns = {}
        if ACTOR in engine.workers:
            loss_fns[ACTOR] = actor_loss_fn(engine.workers[ACTOR], engine.prompt_length,
                                            temperature, self.algorithm)
        if CRITIC in engine.workers:
            loss_fns[CRITIC] = critic_loss_fn(engine.workers[CRITIC], engine.prompt_length,
                                              self.algorithm)
        train_sums: dict[str, float] = {}
        for rows in self._minibatches(experience.batch.batch_size, experience.step):
            for role, loss_fn in loss_fns.items():
                with self.engine.context.span("train", role):
                    result = engine.update(role, experience.batch, rows, loss_fn)
                _accumulate(train_sums, role, result, engine.workers[role])
        return train_sums

    def _minibatches(self, batch_size: int, step: int) -> list[torch.Tensor]:
        """Row indices of every mini-batch of the step: a fresh permutation per epoch."""
        size = batch_size // self.rollout.num_minibatches
        minibatches = []
        for epoch in range(self.rollout.ppo_epochs):
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(
                self.seed * 100_003 + step * 101 + epoch))
            minibatches += [order[start:start + size] for start in range(0, batch_size, size)]
        return minibatches


_EXPERIENCE_SOURCES = ("old_logprobs", "ref_logprobs", "values", "rm_scores", "rule_scores")


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
    # World: the metrics come from the ranks of every model and every rank returns all of them.
    dist.all_gather_object(gathered, (step_metrics, train_sums), group=dist.group.WORLD)
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
