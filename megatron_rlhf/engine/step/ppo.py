"""The PPO algorithm, written in terms of models and operators (no ranks, groups or transfers).

    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed,
                         prompts=prompt_stream.batch)
    for step in range(steps):
        metrics = algorithm.step(step)

A step *produces* experience (generate, score, advantages) and *consumes* it (train actor and
critic, then sync the shadows). With ``rollout.samples_per_prompt = n`` every prompt is sampled
``n`` times into ``n`` contiguous rows (a group); with a critic-free estimator (grpo, rloo,
reinforce++) the engine has no critic, and only the actor is trained. Synchronously, step k
consumes what it just produced. In the asynchronous mode (separation), step k trains on
experience produced ``max_staleness`` steps earlier while the shadows already generate step
``k + max_staleness``: the trainable models and the shadows hold disjoint ranks, so the two
halves run at the same time. The behaviour log-probs
recorded by the shadow are the ones PPO's importance ratio uses, so the update stays correct
off-policy. With ``algorithm.dynamic_sampling`` producing a step may take several generation
rounds, and the groups trained on are chosen from them (``engine/step/dynamic_sampling.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron_rlhf.algorithms import (
    AdaptiveKLController,
    PPOAlgorithmConfig,
    RunningMoments,
    aggregation_denominator,
    build_kl_controller,
    get_off_policy,
    off_policy_metrics,
)
from megatron_rlhf.config.ppo_run import RewardConfig, RolloutConfig
from megatron_rlhf.data.demonstrations import DemonstrationStream
from megatron_rlhf.engine.execution.batch import DistBatch, concat
from megatron_rlhf.engine.execution.episodes import episode_metrics
from megatron_rlhf.engine.execution.experience_fields import (
    EXPERIENCE,
    SPECS,
    TRAINING,
    VERSION_FIELD,
    VERSION_OFFSETS,
    ExperienceFeatures,
    check_experience,
    expected_fields,
)
from megatron_rlhf.engine.execution.function_rewards import FunctionRewards, Record
from megatron_rlhf.engine.execution.ppo_engine import PPOEngine, RuleReward
from megatron_rlhf.engine.step.dynamic_sampling import (
    gather_groups,
    informative_groups,
    select_groups,
    shared_decision,
)
from megatron_rlhf.engine.step.experience import (
    compute_advantages,
    rollout_metrics,
    sequence_scores,
)
from megatron_rlhf.engine.step.handover import WeightHandover, handover_names
from megatron_rlhf.engine.step.staleness import (
    drop_answers,
    stale_answers,
    staleness_metrics,
    token_versions,
)
from megatron_rlhf.engine.step.step_metrics import (
    STEP_END,
    accumulate_train_metrics,
    apply_nan_policy,
    experience_sources,
    nonfinite_experience,
    share_metrics,
)
from megatron_rlhf.engine.step.training_losses import actor_loss_fn, critic_loss_fn
from megatron_rlhf.generation.answer_pool import AnswerPool
from megatron_rlhf.rewards import RewardFunctionSpec
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.metric_reduce import Metric
from megatron_rlhf.runtime.store_exchange import StoreExchange
from megatron_rlhf.topology.models import ACTOR, CRITIC

logger = get_logger(__name__)

PromptSource = Callable[..., tuple[Sequence[Sequence[int]], Sequence[int]]]
"""``(step)`` -> (prompts, their sample ids); with dynamic sampling also called as ``(step,
round_index)`` for a refill round's prompts (``PromptStream.batch``)."""


@dataclass
class Experience:
    """One step's experience on the trainer ranks, with the metrics of producing it."""

    step: int
    batch: DistBatch
    metrics: dict[str, float]
    reward_metrics: dict[str, Metric] = field(default_factory=dict)
    """This rank's means of the reward functions' extra keys (``FunctionRewards.take_extras``)."""
    saved_without: frozenset[str] = frozenset()
    """Declared fields that the checkpoint it was restored from did not write (one from before
    they were recorded, ``experience_ahead.LEGACY_FIELDS``); it trains without them."""


def sample_rows(prompts: Sequence[Sequence[int]], ids: Sequence[int], samples_per_prompt: int
                ) -> tuple[list[Sequence[int]], list[int]]:
    """Every prompt repeated ``n = samples_per_prompt`` times in contiguous rows (its group).

    Sample ``j`` of the prompt with sample id ``i`` gets the id ``i * n + j``, which keys its
    sampling noise: unique over the run (ids are), independent of ranks and chunks, and ``i``
    itself when ``n = 1``.
    """
    n = samples_per_prompt
    rows = [prompt for prompt in prompts for _ in range(n)]
    return rows, [i * n + j for i in ids for j in range(n)]


class PPOAlgorithm:
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
        demonstrations: PPO-ptx's supervised rows of each actor update (``ptx``); None: PPO
            alone.
        ptx_coef: the weight of their mean NLL in the actor's loss (``ptx.coef``).
        function_rewards: the reward functions (``reward.functions``), if any.
        records: step (and refill round, as ``prompts``) -> its prompts' ``(index, record)``, in
            ``prompts``' order (what the reward functions receive); None: empty records.
    """

    def __init__(self, engine: PPOEngine, algorithm: PPOAlgorithmConfig, rollout: RolloutConfig,
                 reward: RewardConfig, seed: int, prompts: PromptSource, total_steps: int,
                 rule_reward: RuleReward | None = None, on_nan: str = "stop",
                 demonstrations: DemonstrationStream | None = None,
                 ptx_coef: float = 0.0, function_rewards: FunctionRewards | None = None,
                 records: Callable[..., Sequence[Record]] | None = None) -> None:
        self.engine = engine
        self.algorithm = algorithm
        self.rollout = rollout
        self.reward = reward
        self.seed = seed
        self.prompts = prompts
        self.total_steps = total_steps
        self.rule_reward = rule_reward
        self.on_nan = on_nan
        self.demonstrations = demonstrations
        self.ptx_coef = ptx_coef
        self.function_rewards = function_rewards
        self.records = records
        self._overlong = reward.overlong(engine.generation.max_new_tokens)
        self.kl_controller = build_kl_controller(algorithm)
        self.score_moments = RunningMoments()
        self._queue: deque[Experience] = deque()
        self._handovers = self._partial_rollouts() if rollout.partial_rollouts else None
        self.answers = (AnswerPool(rollout.samples_per_prompt)
                        if rollout.continue_answers else None)
        """With ``rollout.continue_answers``: this rank's answers that go on across steps (on
        the generating ranks; empty elsewhere)."""
        self.fed_through = -1
        """With ``rollout.continue_answers``: the last step whose prompts the answers hold."""
        faults = engine.context.faults
        self._step_end = StoreExchange(
            STEP_END, stopped=faults.stopped_ranks if faults is not None else None)

    @property
    def staleness(self) -> int:
        """Steps between producing experience and training on it (0: synchronous); answers
        that go on across steps are produced one step ahead."""
        if not self.rollout.async_rollout:
            return 0
        return 1 if self.rollout.continue_answers else self.rollout.max_staleness

    @property
    def features(self) -> ExperienceFeatures:
        """Which optional fields this run's experience holds (``experience_fields.FIELDS``)."""
        return replace(self.engine.experience_features(self.function_rewards is not None),
                       proximal=get_off_policy(self.algorithm.off_policy).needs_proximal)

    @property
    def max_staleness(self) -> int:
        """The most versions a trained token may lag its step (``rollout.max_staleness``; 0
        synchronously)."""
        return self.rollout.max_staleness if self.rollout.async_rollout else 0

    def step(self, step: int) -> dict[str, float]:
        """Run PPO step ``step``; returns its metrics (identical on every rank)."""
        if not self._queue:
            # Synchronous steps, or the first asynchronous one: produce what is trained on now
            # and what the shadows run ahead with.
            for ahead in range(max(1, self.staleness)):
                if step + ahead < self.total_steps:
                    self._queue.append(self.produce(step + ahead, version=step))
        experience = self._queue.popleft()
        train_metrics = {**self.consume(experience), **experience.reward_metrics}
        handover = None
        if self.staleness and step + self.staleness < self.total_steps:
            # Shadows generate ahead while the trainers above were busy; then both meet here,
            # or with partial rollouts inside that generation (engine/step/handover.py).
            handover = self._handover(step)
            self._queue.append(self.produce(step + self.staleness, version=step,
                                            handover=handover))
        if handover is None:
            with self.engine.context.span("sync_weights"):
                self.engine.sync_weights()
        peaks = self.engine.context.memory.take()
        return apply_nan_policy(share_metrics(experience.metrics, train_metrics, peaks,
                                              self._step_end), step,
                                experience_sources(self.engine), self.on_nan)

    def _partial_rollouts(self) -> str:
        """The store-key prefix of this run's hand-overs; refuses placements where a trainer
        generates (hetero-separation's actor)."""
        generating = {role for role, _, _ in self.engine.generation_replicas()}
        if ACTOR in generating:
            raise ValueError("rollout.partial_rollouts=true needs the shadows alone to generate; "
                             "under hetero-separation the trained actor generates too: use "
                             "placement.strategy=separation, or partial_rollouts=false")
        if self.rollout.continue_answers:
            n, rows = self.rollout.samples_per_prompt, self.rollout.rows_per_step
            layout, _ = self.engine.generation_layout(rows)
            shares = sorted({(end - start) for start, end in layout.rows.values()})
            if any(share == 0 or share % n for share in shares):
                raise ValueError(f"rollout.continue_answers=true needs whole groups on every "
                                 f"generating replica: {rows} rows split as {shares} among "
                                 f"them, groups of samples_per_prompt({n}); make "
                                 "prompts_per_step a multiple of the shadow actor's dp")
        return handover_names()

    def _handover(self, step: int) -> WeightHandover | None:
        """With partial rollouts, step ``step``'s hand-over, announced on the trainer ranks."""
        if self._handovers is None:
            return None
        engine = self.engine
        trainers = {rank for role in engine.trainable_roles for rank in engine.plan[role].ranks}
        handover = WeightHandover(engine, self._handovers, step, len(trainers),
                                  self.rollout.partial_handover_check)
        if any(role in engine.workers for role in engine.trainable_roles):
            handover.announce()
        return handover

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's own state: KL controller and running score moments.

        Experience produced ahead (asynchronous mode) is saved apart, by
        ``engine.experience_ahead`` (:attr:`experience_ahead`).
        """
        return {"kl_controller": self.kl_controller.state_dict(),
                "score_moments": self.score_moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. An adaptive KL controller continues from
        its saved coefficient; a fixed one keeps this run's ``kl_coef`` (a resume that changes
        it applies it)."""
        if isinstance(self.kl_controller, AdaptiveKLController):
            self.kl_controller.load_state_dict(state["kl_controller"])
        self.score_moments.load_state_dict(state["score_moments"])

    @property
    def experience_ahead(self) -> list[Experience]:
        """Experience produced ahead and not yet trained on (asynchronous mode), oldest first."""
        return list(self._queue)

    def restore_experience_ahead(self, experiences: Sequence[Experience]) -> None:
        """Continue with ``experiences`` (from a checkpoint) as the experience produced ahead."""
        self._queue = deque(experiences)

    def produce(self, step: int, version: int | None = None,
                handover: WeightHandover | None = None) -> Experience:
        """Generate and score step ``step``'s prompts; advantages on the trainer ranks.

        ``version`` is the weight version that generates (``engine/step/staleness.py``), which
        every response token records; None: ``step``, as in a synchronous step. With a
        ``handover`` (partial rollouts) the shadows take version ``version + 1`` during the
        generation, and the tokens sampled after it record that.

        The prompts go through in ``rollout.pipeline_chunks`` chunks: a generating rank starts on
        chunk ``i + 1`` while the experience models score chunk ``i``. A chunk holds whole
        groups, and every trainer rank receives the whole batch, so a group baseline sees all of
        its rows wherever they were generated.
        """
        batch = self._scored_round(step, 0, handover, step if version is None else version)
        metrics: dict[str, float] = {}
        if self.algorithm.dynamic_sampling:
            batch, metrics = self._dynamic_sample(step, batch)
        features = self.features
        schema = {name: spec for name, spec in batch.schema.items() if name != VERSION_OFFSETS}
        width = schema["response_mask"][1]
        batch.schema = {**schema, **{name: (SPECS[name].dtype, width) for name in
                                     (VERSION_FIELD, "advantages", "returns", "kl")}}
        check_experience(batch.schema, expected_fields(features, EXPERIENCE),
                         f"step {step + 1}'s experience")
        if batch.fields is not None:
            versions = token_versions(batch.fields["response_mask"],
                                      step if version is None else version)
            if features.partial_rollouts:  # the updates during generation
                offsets = batch.fields.pop(VERSION_OFFSETS)
                versions = torch.where(versions >= 0, versions + offsets, versions)
            batch.fields[VERSION_FIELD] = versions
            before = self.state_dict()
            with self.engine.context.span("advantages"):
                batch.fields, advantage_metrics = compute_advantages(
                    batch.fields, self.algorithm, self.kl_controller, self.score_moments,
                    self.reward.model_weight, self.reward.rule_weight,
                    self.rollout.samples_per_prompt,
                    self._function_specs, self._overlong, features=features)
            metrics.update(advantage_metrics)
            metrics.update(rollout_metrics(batch.fields))
            if features.episodes:
                metrics.update(episode_metrics(batch.fields,
                                               self.rollout.environment is not None))
            check_experience(batch.fields, batch.schema, f"step {step + 1}'s experience")
            bad = nonfinite_experience(batch.fields, features)
            if bad:
                self.load_state_dict(before)  # the KL controller must not learn from NaNs
                metrics.update(bad)
        extras: dict[str, Metric] = {}
        if self.function_rewards is not None:
            extras = self.function_rewards.take_extras()
            self.function_rewards.warn_failures(f"step {step + 1}")
        return Experience(step, batch, metrics, extras)

    @property
    def _function_specs(self) -> Sequence[RewardFunctionSpec]:
        return self.reward.specs if self.function_rewards is not None else ()

    def _scored_round(self, step: int, round_index: int,
                      handover: WeightHandover | None = None, version: int = 0) -> DistBatch:
        """Generate and score one round of step ``step``'s prompts (round 0: the step's batch;
        later rounds: dynamic sampling's refills), the rows on the trainer ranks; with a
        ``handover``, every rank takes the new weights before the round is scored."""
        engine = self.engine
        n = self.rollout.samples_per_prompt
        if self.answers is not None:
            return self._continued_round(step, version, handover)
        source = self.prompts(step, round_index) if round_index else self.prompts(step)
        prompts, ids = sample_rows(*source, n)
        records = None
        wanted = self.function_rewards is not None or engine.episodes is not None
        if wanted and self.records is not None:
            chosen = self.records(step, round_index) if round_index else self.records(step)
            records = [record for record in chosen for _ in range(n)]
        size = len(prompts) // self.rollout.pipeline_chunks
        weight_updates = None
        if handover is not None and engine.policy_for_inference in engine.workers:
            tp_group = engine.workers[engine.policy_for_inference].pg_collection.tp
            weight_updates = handover.poll_for(tp_group)
        parts = []
        for chunk, start in enumerate(range(0, len(prompts), size)):
            rollout = engine.generate_rollout(prompts[start:start + size],
                                                ids[start:start + size], chunk,
                                                records[start:start + size] if records else None,
                                                weight_updates)
            if handover is not None:  # one chunk (rollout.partial_rollouts)
                handover.finish()
            parts.append(engine.make_experience(
                rollout, engine.generation.temperature, self.rule_reward, chunk,
                self.function_rewards, records[start:start + size] if records else None))
        engine.finish_transfers()
        return concat(parts)

    def _continued_round(self, step: int, version: int,
                         handover: WeightHandover | None) -> DistBatch:
        """Step ``step``'s round of answers that go on across steps (``rollout.continue_answers``,
        ``generation/answer_pool.py``): the answers take the prompts of every step up to the next
        (this one too, the first time) and return the oldest ``prompts_per_step`` finished
        groups, scored; the shadows take the weights as in ``_scored_round``."""
        engine = self.engine
        first = step if self.fed_through < 0 else self.fed_through + 1
        feed = [sample_rows(*self.prompts(s), self.rollout.samples_per_prompt)
                for s in range(first, min(step + 2, self.total_steps))]
        self.fed_through = max(self.fed_through, step + 1)
        weight_updates = None
        if handover is not None and engine.policy_for_inference in engine.workers:
            tp_group = engine.workers[engine.policy_for_inference].pg_collection.tp
            weight_updates = handover.poll_for(tp_group)
        rollout = engine.continue_rollout(self.answers, [rows for rows, _ in feed],
                                          [ids for _, ids in feed], self.rollout.rows_per_step,
                                          version, weight_updates)
        if handover is not None:
            handover.finish()
        experience = engine.make_experience(rollout, engine.generation.temperature,
                                            self.rule_reward)
        engine.finish_transfers()
        return experience

    def _dynamic_sample(self, step: int, batch: DistBatch) -> tuple[DistBatch, dict[str, float]]:
        """DAPO's dynamic sampling (``engine/step/dynamic_sampling.py``): refill rounds until the step
        has ``prompts_per_step`` groups of unequal scores or ``max_refill_rounds`` ran."""
        n, wanted = self.rollout.samples_per_prompt, self.rollout.prompts_per_step

        features = self.features

        def informative(fields: dict[str, torch.Tensor]) -> list[bool]:
            scores = sequence_scores(fields, self.reward.model_weight, self.reward.rule_weight,
                                     self._function_specs, self._overlong, features=features)
            return informative_groups(scores, n)

        batches = [batch]
        flags = [shared_decision(batch, informative)]
        while sum(map(sum, flags)) < wanted and len(batches) <= self.algorithm.max_refill_rounds:
            batches.append(self._scored_round(step, len(batches)))
            flags.append(shared_decision(batches[-1], informative))
        selection = select_groups(flags, wanted)
        return gather_groups(batches, selection.chosen, n), selection.metrics()

    def consume(self, experience: Experience) -> dict[str, Metric]:
        """Train actor and critic on an experience batch; returns this rank's training metrics.

        Experience with NaN/Inf model outputs is not trained on.
        """
        engine = self.engine
        if experience.batch.fields is not None:
            check_experience(experience.batch.fields,
                             expected_fields(self.features, EXPERIENCE) - experience.saved_without,
                             f"step {experience.step + 1}'s experience, before training")
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
        if not self._drop_stale(experience):
            return {}
        if get_off_policy(self.algorithm.off_policy).needs_proximal:
            self._proximal_logprobs(experience)
        train_metrics: dict[str, Metric] = {}
        minibatches = self._minibatches(experience.batch.batch_size, experience.step)
        for index, rows in enumerate(minibatches):
            for role, loss_fn in loss_fns.items():
                supervised = None
                if role == ACTOR and self.demonstrations is not None:
                    supervised = self._supervised_rows(experience, rows,
                                                       experience.step * len(minibatches) + index)
                with self.engine.context.span("train", role):
                    result = engine.update(role, experience.batch, rows, loss_fn, supervised)
                accumulate_train_metrics(train_metrics, role, result, engine.workers[role])
        return train_metrics

    def _drop_stale(self, experience: Experience) -> bool:
        """Drop the answers staler than this run allows (``staleness.stale_answers``; whole
        groups for a group estimator) and add the step's staleness metrics; False when no
        answer is left to train on."""
        fields = experience.batch.fields
        if fields is None or VERSION_FIELD in experience.saved_without:  # off the trainers
            return True
        versions, mask = fields[VERSION_FIELD], fields["response_mask"]
        group = self.rollout.samples_per_prompt if self.algorithm.needs_groups else 1
        dropped = stale_answers(versions, mask, experience.step, self.max_staleness, group)
        experience.metrics.update(staleness_metrics(versions, mask, experience.step,
                                                    int(dropped.sum())))
        if dropped.any():
            experience.batch.fields = drop_answers(fields, dropped)
        return not bool(dropped.all())

    def _proximal_logprobs(self, experience: Experience) -> None:
        """The actor's log-probs before this step's update (``algorithm.off_policy``), and the
        correction's metrics (``off_policy_metrics``) where they are."""
        engine = self.engine
        if engine.compute_proximal_logprobs(experience.batch, engine.generation.temperature):
            fields = experience.batch.fields
            check_experience(fields, expected_fields(self.features, TRAINING)
                             - experience.saved_without,
                             f"step {experience.step + 1}'s experience, with proximal log-probs")
            truncated = self.algorithm.off_policy == "truncated_is"
            experience.metrics.update(off_policy_metrics(
                fields["gen_logprobs"], fields["proximal_logprobs"], fields["response_mask"],
                self.algorithm.off_policy_cap if truncated else None))

    def _supervised_rows(self, experience: Experience, rows: torch.Tensor,
                         update: int) -> dict[str, torch.Tensor]:
        """The demonstrations of actor update ``update`` with their ``ptx_weight``.

        megatron divides the step's summed loss by the PPO rows' count (response tokens for
        ``token_mean``), and the supervised rows add none; weighting their summed NLL by
        ``coef * ppo_count / supervised_tokens`` makes the step's loss
        ``ppo_loss + coef * mean_nll`` exactly, whatever the DP size and micro-batching.
        """
        supervised = self.demonstrations.batch(update)
        ppo_count = aggregation_denominator(experience.batch.fields["response_mask"][rows],
                                            self.algorithm.loss_aggregation)
        tokens = supervised["loss_mask"][:, 1:].sum().clamp(min=1)
        weight = self.ptx_coef * float(ppo_count) / float(tokens)
        rows_count = supervised["input_ids"].shape[0]
        return {**supervised, "ptx_weight": torch.full((rows_count,), weight)}

    def _minibatches(self, batch_size: int, step: int) -> list[torch.Tensor]:
        """Row indices of every mini-batch of the step: a fresh permutation per epoch."""
        size = batch_size // self.rollout.num_minibatches
        minibatches = []
        for epoch in range(self.rollout.ppo_epochs):
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(
                self.seed * 100_003 + step * 101 + epoch))
            minibatches += [order[start:start + size] for start in range(0, batch_size, size)]
        return minibatches
