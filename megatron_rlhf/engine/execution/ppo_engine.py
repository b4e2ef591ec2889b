"""The execution engine: PPO's operators on placed models, with the data movement around them.

Every rank runs the same sequence of engine calls (SPMD, as under torchrun). An operator bound to
a model runs on that model's ranks only; before it runs, the engine moves the rows each DP
replica needs onto all of the replica's ranks, and its results stay on the replica's last
pipeline stage until the next operator asks for them elsewhere. Ranks that hold no part of a
model skip its compute and only take part in the transfers, so models on disjoint ranks
(interleaving) compute at the same time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.batch import (
    DistBatch,
    merge,
    output_ranks,
    replica_input_layout,
    replica_output_layout,
)
from megatron_rlhf.engine.execution.episodes import STAT_FIELDS, EpisodeRollouts
from megatron_rlhf.engine.execution.experience_fields import (
    SCORED,
    VERSION_OFFSETS,
    ExperienceFeatures,
    check_experience,
    expected_fields,
)
from megatron_rlhf.engine.execution.function_rewards import FunctionRewards, Record, row_token_ids
from megatron_rlhf.engine.execution.transfer import RowLayout, TransferChannels
from megatron_rlhf.engine.execution.workers import ModelWorker
from megatron_rlhf.generation import GenerationConfig, GenerationOutput
from megatron_rlhf.generation.answer_pool import AnswerPool
from megatron_rlhf.models.lora import adapters_disabled
from megatron_rlhf.models.moe import ROUTES
from megatron_rlhf.models.offload import PARTS, WEIGHTS
from megatron_rlhf.refit import WeightSync
from megatron_rlhf.runtime.context import RunContext
from megatron_rlhf.topology.models import ACTOR, CRITIC, REF, REWARD, SHADOW_ACTOR, SHADOW_CRITIC
from megatron_rlhf.topology.placement_config import HETERO_SEPARATION
from megatron_rlhf.topology.plan import PlacementPlan

RuleReward = Callable[[list[int], list[int]], float]
"""(prompt token ids, response token ids) -> rule score of the response."""


class PPOEngine:
    """Operators of a PPO step over a placement plan.

    Args:
        plan: the placement (identical on every rank).
        workers: this rank's model parts, by role.
        weight_syncs: trainable role -> the sync of its weights into its shadow (collective;
            empty when no shadows are placed).
        prompt_length: ``P``, the fixed padded prompt width.
        generation: sampling settings; ``R = max_new_tokens`` is the fixed response width.
        eos_id: end-of-sequence token id, or several (a reply may end with any of them).
        pad_id: padding token id.
        context: where the operators' spans and fault stages are recorded (default: nowhere).
        reuse_generation_logprobs: the rollout carries generation's policy log-probs as
            ``old_logprobs`` and the experience skips the policy's forward pass.
        transfer_timeout_s: timeout of the channels that move rows between models (a receiver
            may wait through a whole generation or scoring stage).
        episodes: multi-turn rollouts with tools (``rollout.tools``); the response width ``R``
            (``generation.max_new_tokens`` here) is then the episode's
            (``rollout.max_episode_tokens``). None: one reply per prompt.
        replayed_routes: ``(layers, topk)`` of a mixture-of-experts policy whose experts per
            token are recorded with the old log-probs (``models.moe.ROUTES``) and replayed in
            every training pass of the actor on those rows; None: no replay.
        reference_is_base: the actor trains LoRA adapters (``models.lora``) and the reference
            log-probs are its own with the adapters switched off, its frozen base (the plan
            then need not place a reference model); False: the reference model's.
        partial_rollouts: the weights may change during a generation call
            (``rollout.partial_rollouts``): the rollout carries ``version_offsets``, the updates
            before each response token.

    Building is collective: it creates the transfer channels (process groups) on every rank.
    """

    def __init__(self, plan: PlacementPlan, workers: dict[str, ModelWorker],
                 weight_syncs: dict[str, WeightSync], prompt_length: int,
                 generation: GenerationConfig, eos_id: int | tuple[int, ...],
                 pad_id: int, context: RunContext | None = None,
                 reuse_generation_logprobs: bool = False,
                 transfer_timeout_s: float = 1800.0,
                 episodes: EpisodeRollouts | None = None,
                 replayed_routes: tuple[int, int] | None = None,
                 reference_is_base: bool = False, partial_rollouts: bool = False) -> None:
        self.plan = plan
        self.partial_rollouts = partial_rollouts
        if not reference_is_base and REF not in plan.models:
            raise ValueError("the plan places no reference model (placement.reference=false) "
                             "and the actor's base is not the reference: place one")
        self.reference_is_base = reference_is_base
        self.replayed_routes = replayed_routes
        self.episodes = episodes
        self.workers = workers
        self.weight_syncs = weight_syncs
        self.prompt_length = prompt_length
        self.generation = generation
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.context = context or RunContext()
        self.reuse_generation_logprobs = reuse_generation_logprobs
        self.rank = dist.get_rank()
        self._node_of = lambda r: plan.cluster.locate(r).node
        faults = self.context.faults
        self.channels = TransferChannels(
            self.transfer_pairs(), transfer_timeout_s,
            stopped=faults.stopped_ranks if faults is not None else None)

    # ----------------------------------------------------------------- roles
    @property
    def policy_for_inference(self) -> str:
        """The model that generates and computes old log-probs: the shadow actor if placed."""
        return SHADOW_ACTOR if SHADOW_ACTOR in self.plan.models else ACTOR

    @property
    def reference(self) -> str:
        """The model that computes the reference log-probs: the actor (adapters off) when the
        reference is its base, else the reference model."""
        return ACTOR if self.reference_is_base else REF

    @property
    def critic_for_inference(self) -> str | None:
        """The model that computes values (the actor itself under AC-Share; None without a
        critic)."""
        if not self.plan.config.critic:
            return None
        if CRITIC not in self.plan.models:
            return self.policy_for_inference
        return SHADOW_CRITIC if SHADOW_CRITIC in self.plan.models else CRITIC

    @property
    def scorer(self) -> str:
        """The model whose ranks score the answers: the reward model (its score, the rule's and
        the reward functions'), or without one the reference model, or without that the actor
        whose base is the reference (the rule's and the functions' alone)."""
        if self.plan.config.reward:
            return REWARD
        return REF if REF in self.plan.models else self.reference

    @property
    def trainable_roles(self) -> tuple[str, ...]:
        """The roles that are trained (actor, and the critic unless AC-Share)."""
        return tuple(r for r in (ACTOR, CRITIC) if r in self.plan.models)

    def trainer_layout(self, batch_size: int) -> RowLayout:
        """Every rank of every trainable model holds every experience row."""
        ranks = sorted({r for role in self.trainable_roles for r in self.plan[role].ranks})
        return RowLayout.replicated(batch_size, ranks)

    def experience_passes(self) -> list[tuple[str, str]]:
        """``(role, output)`` of every forward pass :meth:`make_experience` runs, in order: old
        log-probs (unless generation's are reused), reference log-probs, values (with a critic),
        scores (on the :attr:`scorer`'s ranks)."""
        passes = [] if self.reuse_generation_logprobs else [(self.policy_for_inference,
                                                             "old_logprobs")]
        passes.append((self.reference, "ref_logprobs"))
        if self.critic_for_inference is not None:
            passes.append((self.critic_for_inference, "values"))
        return [*passes, (self.scorer, "scores")]

    def experience_features(self, functions: bool = False) -> ExperienceFeatures:
        """The optional experience fields this engine's batches hold
        (``experience_fields.FIELDS``), from its placement and settings; ``functions``: the
        experience passes score with reward functions."""
        return ExperienceFeatures(critic=self.critic_for_inference is not None,
                                  reward_model=self.plan.config.reward, functions=functions,
                                  episodes=self.episodes is not None,
                                  replayed_routes=self.replayed_routes is not None,
                                  partial_rollouts=self.partial_rollouts)

    def transfer_pairs(self) -> list[tuple[list[int], list[int]]]:
        """Every pair of rank sets that rows move between: the rollout from the generating
        ranks to each experience model and to the trainers, and each experience model's
        results from its last pipeline stage to the trainers."""
        generating = [rank for _, ranks, _ in self.generation_replicas() for rank in ranks]
        trainers = sorted(self.trainer_layout(1).rows)
        pairs = [(generating, trainers)]
        for role, _ in self.experience_passes():
            pairs.append((generating, list(self.plan[role].ranks)))
            pairs.append(([r for ranks in output_ranks(self.plan[role]) for r in ranks],
                          trainers))
        return pairs

    def rollout_schema(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Fields of a rollout batch with their fixed per-row shapes."""
        p, r = self.prompt_length, self.generation.max_new_tokens
        schema = {"input_ids": (torch.int64, (p + r,)), "attention_mask": (torch.int64, (p + r,)),
                  "response_mask": (torch.int64, (r,)), "gen_logprobs": (torch.float32, (r,))}
        if self.reuse_generation_logprobs:
            schema["old_logprobs"] = (torch.float32, (r,))
        if self.partial_rollouts:
            schema[VERSION_OFFSETS] = (torch.int64, (r,))
        if self.episodes is not None:
            schema.update({name: (torch.float32, ()) for name in STAT_FIELDS.values()})
        return schema

    # ------------------------------------------------------------ generation
    def generation_replicas(self) -> list[tuple[str, list[int], float]]:
        """``(role, ranks, speed)`` of every DP replica that generates.

        The generating model's replicas, and under hetero-separation also the trainable actor's
        (idle during generation; pp=1 only), each weighted by its pool's relative speed.
        """
        roles = [self.policy_for_inference]
        if self.plan.config.strategy == HETERO_SEPARATION and self.plan[ACTOR].pp == 1:
            roles.append(ACTOR)
        replicas = []
        for role in roles:
            model = self.plan[role]
            for d in range(model.dp):
                ranks = model.replica_ranks(d)
                speed = self.plan.cluster.pools[self.plan.cluster.locate(ranks[0]).pool_index]
                replicas.append((role, ranks, speed.relative_speed))
        return replicas

    def generation_layout(self, batch_size: int) -> tuple[RowLayout, dict[int, str]]:
        """Rows per generating replica, in proportion to its speed; and each rank's role."""
        replicas = self.generation_replicas()
        total = sum(speed for _, _, speed in replicas)
        ideal = [batch_size * speed / total for _, _, speed in replicas]
        counts = [int(x) for x in ideal]
        by_remainder = sorted(range(len(ideal)), key=lambda i: (counts[i] - ideal[i], i))
        for i in by_remainder[:batch_size - sum(counts)]:
            counts[i] += 1
        rows, roles, start = {}, {}, 0
        for (role, ranks, _), count in zip(replicas, counts, strict=True):
            for rank in ranks:
                rows[rank], roles[rank] = (start, start + count), role
            start += count
        return RowLayout(batch_size, rows), roles

    def generate_rollout(self, prompts: Sequence[Sequence[int]],
                           prompt_indices: Sequence[int], chunk: int = 0,
                           records: Sequence[Record] | None = None,
                           weight_updates: Callable[[], bool] | None = None) -> DistBatch:
        """Each generating DP replica samples responses for its share of the prompts.

        Every rank passes the whole prompt list; no prompt data is moved. Sampling is keyed by
        prompt index, so the split does not change any response. When tracing, the ``generate``
        span's ``work`` records what ran: this rank's TP rank (every TP rank of a replica runs
        the same micro-batches, each on its shard) and each micro-batch's
        :class:`~megatron_rlhf.generation.MicroBatchWork` as a dict. With ``episodes`` each
        row is an episode (``records``: each row's prompt record, which its tool calls read).
        ``weight_updates``: this rank's hand-over of new weights between decode steps (partial
        rollouts; ``engine/step/handover.py``).
        """
        layout, roles = self.generation_layout(len(prompts))
        rows = layout.held_by(self.rank)
        fields = None
        if rows is not None and rows[1] > rows[0]:
            start, end = rows
            worker = self.workers[roles[self.rank]]
            stats = {}
            with self.context.span("generate", roles[self.rank], chunk) as span:
                if self.episodes is not None:
                    output, stats = self.episodes.run(
                        worker, prompts[start:end], prompt_indices[start:end],
                        records[start:end] if records else [(-1, {})] * (end - start),
                        self.generation, self.eos_id, self.pad_id)
                else:
                    output = worker.generate(prompts[start:end], prompt_indices[start:end],
                                             self.generation, self.eos_id, self.pad_id,
                                             weight_updates)
                if span is not None:
                    span.work = {"tp_rank": worker.pg_collection.tp.rank(),
                                 "micro_batches": [dataclasses.asdict(work)
                                                   for work in output.micro_batches]}
            fields = {**self._fixed_width(output), **stats}
        elif rows is not None:  # a replica left without prompts by an uneven split
            self.workers[roles[self.rank]].generate_nothing(self.generation, self.pad_id)
        return DistBatch(layout, self.rollout_schema(), fields)

    def continue_rollout(self, answers: AnswerPool, feed: Sequence[Sequence[Sequence[int]]],
                         feed_ids: Sequence[Sequence[int]], rows: int, version: int,
                         weight_updates: Callable[[], bool] | None = None) -> DistBatch:
        """:meth:`generate_rollout` for answers that go on across steps
        (``rollout.continue_answers``; ``generation/answer_pool.py``): each generating replica
        queues its share of every batch of ``feed`` (each ``rows`` prompts, with their
        ``feed_ids``) into its ``answers`` and returns the oldest ``rows`` of its share's worth
        of finished groups, tokens of the calls before this one included. ``version``: the
        generating weights' version as the call starts (the tokens' versions are offsets from
        it). Every rank passes the same arguments; each replica's share is whole groups."""
        layout, roles = self.generation_layout(rows)
        held = layout.held_by(self.rank)
        fields = None
        if held is not None:
            start, end = held
            worker = self.workers[roles[self.rank]]
            with self.context.span("generate", roles[self.rank]) as span:
                output = worker.continue_generate(
                    answers, [p for batch in feed for p in batch[start:end]],
                    [i for ids in feed_ids for i in ids[start:end]],
                    (end - start) // answers.group_size, version, self.generation, self.eos_id,
                    self.pad_id, weight_updates)
                if span is not None:
                    span.work = {"tp_rank": worker.pg_collection.tp.rank(),
                                 "micro_batches": [dataclasses.asdict(work)
                                                   for work in output.micro_batches]}
            fields = self._fixed_width(output)
        return DistBatch(layout, self.rollout_schema(), fields)

    def _fixed_width(self, output: GenerationOutput) -> dict[str, torch.Tensor]:
        """Re-pad a generation output to the fixed ``P`` prompt and ``R`` response widths."""
        p, r = self.prompt_length, self.generation.max_new_tokens
        if output.prompt_length > p:
            raise ValueError(f"a prompt has {output.prompt_length} tokens, more than "
                             f"rollout.max_prompt_length={p}; raise it or truncate prompts")
        b, r_out = output.response_mask.shape
        device = output.input_ids.device
        ids = torch.full((b, p + r), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(b, p + r, dtype=torch.long, device=device)
        ids[:, p - output.prompt_length:p + r_out] = output.input_ids
        mask[:, p - output.prompt_length:p + r_out] = output.attention_mask
        response_mask = torch.zeros(b, r, dtype=torch.long, device=device)
        response_mask[:, :r_out] = output.response_mask
        # gen_logprobs: the generating model's log-probs of its tokens under the policy at the
        # sampling temperature (before top-k/top-p), to set against the trainer's forward
        fields = {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask,
                  "gen_logprobs": self._response_width(output.response_policy_logprobs)}
        if self.reuse_generation_logprobs:
            fields["old_logprobs"] = self._response_width(output.response_policy_logprobs)
        if self.partial_rollouts:
            versions = output.response_versions
            fields[VERSION_OFFSETS] = self._response_width(
                torch.zeros_like(output.response_mask) if versions is None else versions)
        return fields

    def _response_width(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, R_out]`` response values, zero-padded on the right to ``[b, R]``."""
        return torch.nn.functional.pad(values, (0, self.generation.max_new_tokens
                                                - values.shape[1]))

    # ------------------------------------------------------------ experience
    def make_experience(self, rollout: DistBatch, temperature: float,
                        rule_reward: RuleReward | None = None, chunk: int = 0,
                        function_rewards: FunctionRewards | None = None,
                        records: Sequence[Record] | None = None) -> DistBatch:
        """Old log-probs, reference log-probs, values and scores of a rollout, on the trainers.

        Without a critic there are no values, and with ``reuse_generation_logprobs`` the old
        log-probs come with the rollout (one pass fewer each). The inputs of all forward passes
        are moved first, then each model computes on its
        own ranks, so models on disjoint ranks run at the same time. Scores come as the reward
        model's ``rm_scores`` (none without a reward model) and the rule's ``rule_scores`` (zero
        without a rule). Rows move
        on each pair of models' own channel (``transfer_pairs``) and sends are left in flight
        there (``finish_transfers`` waits for them), so a rank that only produced the rollout
        goes straight on to its next chunk. With ``function_rewards`` the scorer's ranks
        also score their rows with them (``records``: each row's prompt record), adding
        ``function_scores`` and ``reward_errors`` (``engine/execution/function_rewards.py``).

        Raises:
            ValueError: reusing generation's log-probs at another ``temperature``.
        """
        p, r = self.prompt_length, self.generation.max_new_tokens
        if self.reuse_generation_logprobs and temperature != self.generation.temperature:
            raise ValueError(f"old log-probs at temperature {temperature} cannot come from "
                             f"generation at {self.generation.temperature} "
                             "(rollout.reuse_generation_logprobs=true)")
        computations = {
            "old_logprobs": self._old_logprobs(p, r, temperature),
            "ref_logprobs": ({"ref_logprobs": (r,)}, lambda w, f, rows: {
                "ref_logprobs": _base_logprobs(w, f, p, temperature)}),
            "values": ({"values": (r,)}, lambda w, f, rows: {"values": w.compute_values(f, p)}),
            "scores": (self._score_shapes(function_rewards),
                       lambda w, f, rows: self._scores(
                           w, f, rule_reward, function_rewards,
                           records[rows[0]:rows[1]] if records else None)),
        }
        passes = [(role, output, *computations[output])
                  for role, output in self.experience_passes()]
        inputs = rollout.select(["input_ids", "attention_mask"])
        with self.context.span("transfer", "experience-inputs", chunk):
            staged = [inputs.moved_to(replica_input_layout(self.plan[role], rollout.batch_size),
                                      self._node_of, self.channels)
                      for role, _, _, _ in passes]
        outputs = []
        for (role, output, shapes, compute), staged_inputs in zip(passes, staged, strict=True):
            results = None
            if staged_inputs.fields is not None:
                with self.context.span("experience", role, chunk):
                    results = compute(self.workers[role], staged_inputs.fields,
                                      staged_inputs.rows())
                if any(value is None for value in results.values()):
                    results = None  # a pipeline stage without outputs
            elif role in self.workers and (output != "scores" or self.plan.config.reward):
                self.workers[role].forward_nothing()  # no rows here (an uneven split)
            outputs.append(DistBatch(
                replica_output_layout(self.plan[role], rollout.batch_size),
                {name: (torch.float32, shape) for name, shape in shapes.items()}, results))
        with self.context.span("transfer", "experience-outputs", chunk):
            scored = merge([rollout, *outputs], self.trainer_layout(rollout.batch_size),
                           self._node_of, self.channels)
        check_experience(scored.schema, expected_fields(
            self.experience_features(function_rewards is not None), SCORED), "scored rows")
        return scored

    def _old_logprobs(self, p: int, r: int, temperature: float) -> tuple[dict, Callable]:
        """Shapes and computation of the policy's experience pass: its log-probs, and its
        routes when they are replayed."""
        if self.replayed_routes is None:
            return {"old_logprobs": (r,)}, lambda w, f, rows: {
                "old_logprobs": w.compute_log_prob(f, p, temperature)}

        def with_routes(worker: ModelWorker, fields: dict, rows) -> dict:
            logprobs, routes = worker.compute_log_prob_and_routes(fields, p, temperature)
            return {"old_logprobs": logprobs,
                    ROUTES: None if routes is None else routes.float()}

        return {"old_logprobs": (r,), ROUTES: (p + r, *self.replayed_routes)}, with_routes

    def finish_transfers(self) -> None:
        """Wait for this rank's sends still in flight."""
        with self.context.span("transfer", "wait-sends"):
            self.channels.drain()

    def _score_shapes(self, function_rewards: FunctionRewards | None
                      ) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"rm_scores": ()} if self.plan.config.reward else {}
        shapes["rule_scores"] = ()
        if function_rewards is not None:
            shapes.update(function_scores=(function_rewards.count,), reward_errors=())
        return shapes

    def _scores(self, worker: ModelWorker, fields: dict[str, torch.Tensor],
                rule_reward: RuleReward | None, function_rewards: FunctionRewards | None,
                records: Sequence[Record] | None) -> dict[str, torch.Tensor | None]:
        # Results sit on the last pipeline stage, as the reward model's scores do.
        scores = {}
        if self.plan.config.reward:
            scores["rm_scores"] = worker.compute_scores(fields)
            if scores["rm_scores"] is None:
                return dict.fromkeys(self._score_shapes(function_rewards))
        elif not worker.is_output_stage:
            return dict.fromkeys(self._score_shapes(function_rewards))
        ids, mask = fields["input_ids"], fields["attention_mask"]
        device = scores["rm_scores"].device if scores else ids.device
        rows = ids.shape[0]
        scores["rule_scores"] = torch.zeros(rows, dtype=torch.float32, device=device)
        if rule_reward is not None:
            scores["rule_scores"] = rule_scores_of(ids, mask, self.prompt_length,
                                                   rule_reward).to(device)
        if function_rewards is not None:
            found = function_rewards.score(
                ids, mask, self.prompt_length,
                records if records is not None else [(-1, {})] * rows,
                keep_extras=worker.pg_collection.tp.rank() == 0)
            scores.update({name: value.to(device) for name, value in found.items()})
        return scores

    # -------------------------------------------------------------- training
    def update(self, role: str, experience: DistBatch, minibatch_rows: torch.Tensor,
               loss_fn, supervised: dict[str, torch.Tensor] | None = None) -> dict:
        """One optimizer step of ``role`` (held by this rank) on experience rows.

        Every trainer rank holds all experience rows; DP replica ``d`` trains on the ``d``-th
        share of the mini-batch, so no data moves. ``supervised`` rows (PPO-ptx, every rank
        holds all of them) are shared out the same way and join the same step.
        """
        worker = self.workers[role]
        dp_rank, dp = worker.pg_collection.dp.rank(), self.plan[role].dp
        rows = _replica_share(minibatch_rows, dp_rank, dp)
        rows = rows.to(next(iter(experience.fields.values())).device)
        fields = {name: tensor[rows] for name, tensor in experience.fields.items()
                  if name != ROUTES or role == ACTOR}  # the policy's routes, for the policy
        if supervised is not None:
            supervised = {name: _replica_share(tensor, dp_rank, dp)
                          for name, tensor in supervised.items()}
        return worker.train(fields, loss_fn, supervised)

    def compute_proximal_logprobs(self, experience: DistBatch, temperature: float) -> bool:
        """The actor's log-probs of every experience row before this step's first update, as
        the batch's ``proximal_logprobs`` (an off-policy correction's proximal policy).

        DP replica ``d`` computes the ``d``-th share of the rows and the replicas gather them,
        so every rank of the actor's last stage holds all of them, as it holds every other
        field; other ranks get none (no loss is computed there). Collective over the actor's
        ranks. Returns whether this rank holds them.

        Raises:
            ValueError: the actor's DP size does not divide the batch.
        """
        if ACTOR not in self.workers or experience.fields is None:
            return False
        worker = self.workers[ACTOR]
        dp_rank, dp = worker.pg_collection.dp.rank(), self.plan[ACTOR].dp
        if experience.batch_size % dp:
            raise ValueError(f"the actor's dp({dp}) does not divide the step's "
                             f"{experience.batch_size} rows; the proximal log-probs "
                             "(algorithm.off_policy) are computed in equal shares")
        device = experience.fields["input_ids"].device
        rows = _replica_share(torch.arange(experience.batch_size, device=device), dp_rank, dp)
        fields = {name: experience.fields[name][rows] for name in ("input_ids", "attention_mask")}
        with self.context.span("experience", ACTOR):
            share = worker.compute_log_prob(fields, self.prompt_length, temperature)
        if share is None:  # not the last pipeline stage
            return False
        shares = [torch.empty_like(share) for _ in range(dp)]
        dist.all_gather(shares, share.contiguous(), group=worker.pg_collection.dp)
        experience.fields["proximal_logprobs"] = torch.cat(shares)
        return True

    def sync_weights(self) -> None:
        """Copy trained weights into the shadows (no-op without shadows). Collective."""
        for role in self.trainable_roles:
            if role in self.weight_syncs:
                shadow = SHADOW_ACTOR if role == ACTOR else SHADOW_CRITIC
                with self.resident(WEIGHTS, roles=(role, shadow)):
                    self.weight_syncs[role].sync()

    @contextlib.contextmanager
    def resident(self, *parts: str, roles: Sequence[str] | None = None) -> Iterator[None]:
        """Keep ``parts`` (default: all) of this rank's models (or of ``roles``) on their devices
        for the duration: for code that reads or writes model state outside the operators
        (weight sync, checkpoints, export)."""
        with contextlib.ExitStack() as stack:
            for role, worker in self.workers.items():
                if roles is None or role in roles:
                    stack.enter_context(worker.resident(*(parts or PARTS)))
            yield


def _replica_share(rows: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """DP replica ``dp_rank``'s contiguous ``1/dp`` of ``rows`` (along the first dimension)."""
    share = rows.shape[0] // dp
    return rows[dp_rank * share:(dp_rank + 1) * share]


def rule_scores_of(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                   rule_reward: RuleReward) -> torch.Tensor:
    """The rule's score of every row ``[b]`` (float32, on the CPU: the rule reads Python lists)."""
    return torch.tensor([rule_reward(prompt, response) for prompt, response in
                         row_token_ids(input_ids, attention_mask, prompt_length)],
                        dtype=torch.float32)


def _base_logprobs(worker: ModelWorker, fields: dict[str, torch.Tensor], prompt_length: int,
                   temperature: float) -> torch.Tensor:
    """The log-probs of ``worker``'s model with any LoRA adapters off: the reference's."""
    with adapters_disabled(worker.model):
        return worker.compute_log_prob(fields, prompt_length, temperature)
