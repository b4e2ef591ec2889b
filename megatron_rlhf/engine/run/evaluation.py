"""Held-out evaluation of the policy, and the reward-hacking check built on it.

    evaluator = HeldOutEvaluator(engine, prompts, rule_reward)
    metrics = evaluator.evaluate()      # {"eval/greedy/rule_score": ..., "eval/sampled/kl": ...}

The policy (the generating model) answers a fixed set of held-out prompts twice, greedily and by
sampling at the training temperature; the reward model and the rule score every answer through
the same operators as PPO's experience. Sampling noise is keyed by prompt index (offset past any
training index), so every evaluation of a run draws the same noise and evaluations differ only
by the policy. :func:`hacking_report` compares an evaluation with the first one of the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_rlhf.algorithms import kl_penalty, mean_sequence_kl
from megatron_rlhf.engine.execution.episodes import STAT_FIELDS, episode_metrics
from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures
from megatron_rlhf.engine.execution.function_rewards import FunctionRewards
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine, RuleReward
from megatron_rlhf.generation import GenerationConfig
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.store_exchange import StoreExchange

logger = get_logger(__name__)

EVAL_ID_OFFSET = 1 << 40
"""Added to a held-out prompt's position to key its sampling noise: no training id reaches it."""
MODES = ("greedy", "sampled")
"""How the policy answers: argmax decoding, and sampling as in training."""


def answering_config(sampling: GenerationConfig, mode: str) -> GenerationConfig:
    """How the policy answers held-out prompts in ``mode``: every row greedy, or every row
    sampled as in training (``greedy_every`` mixes greedy rows into training batches only)."""
    return dataclasses.replace(sampling, greedy=mode == "greedy", greedy_every=0)


class HeldOutEvaluator:
    """Scores the current policy on held-out prompts. Collective: every rank calls it.

    Args:
        engine: the PPO engine whose generating model is evaluated.
        prompts: token ids of the held-out prompts (each fits ``rollout.max_prompt_length``).
        rule_reward: the rule score of an answer, or None (rule scores are then 0).
        decode: token ids -> text, for the logged examples.
        log_examples: how many answers of each mode to log per evaluation.
        function_rewards: the run's reward functions, if any: each answer is also scored by
            them (``eval/<mode>/reward/<function>``, ``eval/<mode>/reward/errors``).
        records: each held-out prompt's record, what the reward functions receive (default:
            empty records).
    """

    def __init__(self, engine: PPOEngine, prompts: Sequence[Sequence[int]],
                 rule_reward: RuleReward | None, decode: Callable[[list[int]], str],
                 log_examples: int = 0, function_rewards: FunctionRewards | None = None,
                 records: Sequence[Mapping[str, Any]] | None = None) -> None:
        if not prompts:
            raise ValueError("the held-out evaluation set is empty; set evaluation.paths or "
                             "evaluation.num_prompts=0")
        self.engine = engine
        self.prompts = [list(p) for p in prompts]
        self.ids = [EVAL_ID_OFFSET + i for i in range(len(prompts))]
        self.rule_reward = rule_reward
        self.decode = decode
        self.log_examples = log_examples
        self.function_rewards = function_rewards
        self.records = list(enumerate(records if records is not None else [{}] * len(prompts)))

    def evaluate(self) -> dict[str, float]:
        """``eval/<mode>/{rm_score,rm_score_std,rule_score,answers,response_length}`` for both
        modes (the ``rm_`` ones with a reward model; ``eval/<mode>/reward/<function>`` and
        ``eval/<mode>/reward/errors`` with reward functions), and
        ``eval/sampled/kl`` (KL per sequence to the reference; greedy tokens give no unbiased
        estimate), and with tools or an environment the episodes' ``eval/<mode>/rollout/*``;
        identical on every rank."""
        metrics: dict[str, float] = {}
        for mode in MODES:
            metrics.update(self._answer_and_score(mode))
        # Only the ranks holding experience rows computed metrics; every rank returns them. Through
        # the job's store, not a world collective: under separation the trainers hold no rows
        # and would wait in it, under its timeout, while the other ranks answer and score.
        faults = self.engine.context.faults
        exchange = StoreExchange("evaluation",
                                 stopped=faults.stopped_ranks if faults is not None else None)
        return next(m for m in exchange.all_gather_object(metrics) if m)

    def _answer_and_score(self, mode: str) -> dict[str, float]:
        """This rank's metrics of one mode (empty on ranks that hold no experience rows)."""
        engine = self.engine
        sampling = engine.generation
        engine.generation = answering_config(sampling, mode)
        try:
            rollout = engine.generate_rollout(self.prompts, self.ids, 0, self.records)
            batch = engine.make_experience(rollout, sampling.temperature, self.rule_reward, 0,
                                           self.function_rewards, self.records)
            engine.finish_transfers()
        finally:
            engine.generation = sampling
        if self.function_rewards is not None:
            self.function_rewards.take_extras()  # a dict's other keys are logged in training only
            self.function_rewards.warn_failures(f"the {mode} evaluation")
        if batch.fields is None:
            return {}
        fields = batch.fields
        mask = fields["response_mask"]
        self._log_examples(mode, fields)
        metrics = {}
        if self._features.reward_model:
            metrics[f"eval/{mode}/rm_score"] = fields["rm_scores"].mean().item()
            metrics[f"eval/{mode}/rm_score_std"] = fields["rm_scores"].std(unbiased=False).item()
        metrics.update({f"eval/{mode}/rule_score": fields["rule_scores"].mean().item(),
                        f"eval/{mode}/answers": float(mask.shape[0]),
                        f"eval/{mode}/response_length": mask.sum(dim=1).float().mean().item()})
        if self.function_rewards is not None:
            scores = fields["function_scores"]
            for i, spec in enumerate(self.function_rewards.functions.specs):
                metrics[f"eval/{mode}/{spec.metric}"] = scores[:, i].mean().item()
            metrics[f"eval/{mode}/reward/errors"] = fields["reward_errors"].sum().item()
        if self._features.episodes:
            metrics.update({f"eval/{mode}/{key}": value
                            for key, value in episode_metrics(fields, self._environment).items()})
        if mode == "sampled":
            kl = kl_penalty(fields["old_logprobs"], fields["ref_logprobs"], mask, "k1")
            metrics["eval/sampled/kl"] = mean_sequence_kl(kl, mask).item()
        return metrics

    @property
    def _features(self) -> ExperienceFeatures:
        """Which optional fields the scored answers hold (``experience_fields.FIELDS``)."""
        return self.engine.experience_features(self.function_rewards is not None)

    @property
    def _environment(self) -> bool:
        """Whether an environment answers the episodes (its rewards are then a score)."""
        episodes = self.engine.episodes
        return episodes is not None and episodes.environment is not None

    def _log_examples(self, mode: str, fields: dict[str, torch.Tensor]) -> None:
        p = self.engine.prompt_length
        for i in range(min(self.log_examples, len(fields["input_ids"]))):
            ids, mask = fields["input_ids"][i], fields["attention_mask"][i].bool()
            logger.info("held-out %s answer: %r -> %r%s", mode,
                        self.decode(ids[:p][mask[:p]].tolist()),
                        self.decode(ids[p:][mask[p:]].tolist()), self._example_scores(fields, i))

    def _example_scores(self, fields: dict[str, torch.Tensor], row: int) -> str:
        """`` (reward model 0.123, rule 1.000)``: the scores a row has, from the sources the run
        scores with (none: an empty string)."""
        sources = [("reward model", "rm_scores", self._features.reward_model),
                   ("rule", "rule_scores", self.rule_reward is not None),
                   ("environment", STAT_FIELDS["reward"], self._environment)]
        scores = [f"{name} {fields[key][row].item():.3f}" for name, key, used in sources if used]
        return f" ({', '.join(scores)})" if scores else ""


def hacking_report(first: dict[str, float], current: dict[str, float], tolerance: float,
                   rm_rise: float) -> list[str]:
    """Lines naming each mode whose reward-model score rose while its rule score fell.

    Args:
        first: the run's first evaluation (the initial policy).
        current: a later evaluation.
        tolerance: how far the rule score must fall below ``first``'s to count.
        rm_rise: how far the mean reward-model score must rise above ``first``'s to count, in
            standard errors of that change, ``sqrt((std_first**2 + std_current**2) / n)`` over
            the ``n`` answers of each evaluation (the reward model's scale is arbitrary, and
            the mean of ``n`` answers moves by far less than one answer's spread).

    Returns:
        One line per such mode, with both scores before and after; empty when none diverge.
    """
    lines = []
    for mode in MODES:
        rm, rule = f"eval/{mode}/rm_score", f"eval/{mode}/rule_score"
        if rm not in first or rm not in current:
            continue
        rise = current[rm] - first[rm]
        # Every evaluation of a run answers the same prompts; the current one's count is read
        # because a resumed run's first evaluation may come from a record written without it.
        spread = math.sqrt((first[f"eval/{mode}/rm_score_std"] ** 2
                            + current[f"eval/{mode}/rm_score_std"] ** 2)
                           / current[f"eval/{mode}/answers"])
        if rise > rm_rise * spread and current[rule] < first[rule] - tolerance:
            lines.append(f"{mode} answers: reward-model score {first[rm]:.3f} -> "
                         f"{current[rm]:.3f} while the rule score fell {first[rule]:.3f} -> "
                         f"{current[rule]:.3f}")
    return lines


def eval_metrics(record: dict) -> dict[str, float]:
    """The held-out evaluation metrics of a metrics record (empty if it has none)."""
    return {key: value for key, value in record.items() if key.startswith("eval/")}

