"""What one PPO step does, in the shapes the cost model needs.

    rollout = RolloutSpec(batch=1024, prompt_length=256, generation_length=256)
    rollout = RolloutSpec.from_run_config(run_config)   # a RunConfig, read by attribute

Without ``answer_lengths`` every sequence is taken at full length (``prompt_length +
generation_length``): generation is priced as if no sequence stopped early, which is what a step
costs when responses reach ``max_new_tokens`` (an upper bound otherwise). With a length
distribution (``AnswerLengths``) generation is priced answer by answer as the engine batches it
(``cost_model.decode_schedule``), and the other stages at the mean answer:

    lengths = AnswerLengths.from_mean_max(1019, 3840)     # or .from_samples(measured, cap)
    rollout = RolloutSpec(batch=2048, prompt_length=256, generation_length=3840,
                          answer_lengths=lengths)
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

QUANTILE_POINTS = 4096
"""Points of the quantile table ``AnswerLengths.from_mean_max`` builds."""
QUEUE_SEED = 0
"""Seed of the fixed order in which ``AnswerLengths.replica_queue`` queues a replica's answers:
the engine takes prompts in the order given, which is unrelated to how long their answers get."""


@dataclass(frozen=True)
class AnswerLengths:
    """How long the answers of a step are: a sorted table of lengths (tokens) standing for the
    distribution, and where it came from.

    Attributes:
        lengths: answer lengths, sorted, each in ``[1, cap]``: measured answers, reference
            answers, or the quantiles of an assumed distribution.
        cap: the longest answer allowed (``generation.max_new_tokens``).
        source: the assumption, in words (``--plan-only`` prints it).
    """

    lengths: tuple[int, ...]
    cap: int
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("answer lengths: no lengths given")
        if not isinstance(self.cap, int) or self.cap < 1:
            raise ValueError(f"answer lengths: cap={self.cap!r} must be an integer >= 1")
        if list(self.lengths) != sorted(self.lengths) or self.lengths[0] < 1 or (
                self.lengths[-1] > self.cap):
            raise ValueError(f"answer lengths must be sorted integers in [1, cap={self.cap}]: "
                             "build them with AnswerLengths.from_samples")

    @classmethod
    def from_samples(cls, samples: Sequence[float], cap: int, source: str = "") -> AnswerLengths:
        """Measured (or reference) answer lengths, each clipped to ``[1, cap]``."""
        lengths = tuple(sorted(min(cap, max(1, round(x))) for x in samples))
        return cls(lengths, cap, source or f"{len(lengths)} answer lengths given")

    @classmethod
    def from_mean_max(cls, mean: float, cap: int, points: int = QUANTILE_POINTS) -> AnswerLengths:
        """Answers of mean ``mean`` that stop at ``cap``: exponentially distributed (the most
        spread-out distribution of a given mean), an answer longer than ``cap`` cut there.

        With rate ``lam`` the clipped mean is ``(1 - exp(-lam cap)) / lam``; ``lam`` is solved
        for ``mean`` and the table holds the quantiles ``min(cap, -ln(1 - q) / lam)`` at
        ``q = (i + 1/2) / points``. A mean at or above ``cap`` gives every answer ``cap``.

        Raises:
            ValueError: ``mean`` below 1 or ``cap`` below 1.
        """
        if not mean >= 1 or cap < 1:
            raise ValueError(f"answer lengths: mean={mean!r} and max={cap!r} must be >= 1")
        if mean >= cap:
            return cls((cap,) * points, cap, f"every answer {cap} tokens (mean >= max)")
        lam = _clipped_exponential_rate(mean, cap)
        lengths = tuple(min(cap, max(1, round(-math.log1p(-(i + 0.5) / points) / lam)))
                        for i in range(points))
        clipped = math.exp(-lam * cap)
        return cls(lengths, cap, f"exponential answers of mean {mean:g} tokens cut at {cap} "
                                 f"({100 * clipped:.1f}% reach it)")

    @functools.cached_property
    def mean(self) -> float:
        """Mean answer length."""
        return sum(self.lengths) / len(self.lengths)

    def quantile(self, q: float) -> int:
        """The table's length at quantile ``q`` in [0, 1] (nearest rank)."""
        index = min(len(self.lengths) - 1, max(0, math.ceil(q * len(self.lengths)) - 1))
        return self.lengths[index]

    def batch(self, rows: int) -> list[int]:
        """The lengths of a step of ``rows`` answers, ascending: the quantiles at
        ``j / (rows + 1)``, ``j = 1..rows`` (the expected positions of ``rows`` draws)."""
        return [self.quantile(j / (rows + 1)) for j in range(1, rows + 1)]

    def replica_queue(self, rows: int, batch: int) -> list[int]:
        """The answers of the replica that waits longest, ``rows`` of the step's ``batch``, in
        the order it generates them.

        The step's answers (``batch``) are dealt to the replicas in turn from the longest down,
        so this replica gets the longest answer of the step and every ``batch / rows``-th one
        after it; the queue order is a fixed shuffle (``QUEUE_SEED``)."""
        return list(_replica_queue(self.lengths, rows, batch)) if rows > 0 else []

    def to_dict(self) -> dict:
        """JSON-ready summary: the assumption, mean, median, p90, p99, max, cap, count."""
        return {"source": self.source, "mean": round(self.mean, 1),
                "p50": self.quantile(0.5), "p90": self.quantile(0.9),
                "p99": self.quantile(0.99), "max": self.lengths[-1], "cap": self.cap,
                "count": len(self.lengths)}

    def describe(self) -> str:
        """One line: the assumption and its figures."""
        d = self.to_dict()
        return (f"{d['source']}: mean {d['mean']:g}, median {d['p50']}, p90 {d['p90']}, "
                f"p99 {d['p99']}, max {d['max']} tokens")


@functools.lru_cache(maxsize=256)
def _replica_queue(lengths: tuple[int, ...], rows: int, batch: int) -> tuple[int, ...]:
    """``AnswerLengths.replica_queue`` of the table ``lengths``, kept: a placement search prices
    the same replica many times."""
    table = AnswerLengths(lengths, max(lengths))
    every = table.batch(batch)
    stride = batch / rows
    mine = [every[batch - 1 - math.floor(i * stride)] for i in range(rows)]
    random.Random(QUEUE_SEED).shuffle(mine)
    return tuple(mine)


def _clipped_exponential_rate(mean: float, cap: int) -> float:
    """The rate ``lam`` with ``(1 - exp(-lam cap)) / lam == mean`` (``0 < mean < cap``), by
    bisection: the clipped mean falls from ``cap`` (``lam -> 0``) to 0 as ``lam`` grows."""
    low, high = 1e-12, 1.0
    while (1 - math.exp(-high * cap)) / high > mean:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if (1 - math.exp(-mid * cap)) / mid > mean:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass(frozen=True)
class RolloutSpec:
    """Shapes of one PPO step.

    Attributes:
        batch: sequences per step (``rollout.prompts_per_step * samples_per_prompt``); one
            sample is one prompt with one response.
        prompt_length: prompt tokens (``rollout.max_prompt_length``).
        generation_length: response tokens (``generation.max_new_tokens``).
        ppo_epochs: passes over the experience per step.
        num_minibatches: optimizer steps per epoch.
        micro_batch_size: rows per forward/backward micro-batch on one DP replica, in the
            experience and training stages.
        activation_checkpointing: recompute every layer's activations in the backward pass
            (stores only layer inputs; one more forward pass of compute) in every trainer;
            False leaves it to the planner, per model, where memory needs it.
        overlap: let strategies with shadow models (separation, hetero-separation) generate
            rollout k+1 while training on rollout k; False prices the synchronous schedule.
        answer_lengths: the answers' length distribution (capped at ``generation_length``);
            None: every answer ``generation_length`` tokens.
        batching: how a replica batches its answers (``generation.batching``):
            ``continuous`` refills a finished answer's slot from the queue, ``static`` runs
            rounds that each wait for their longest answer. Only priced with
            ``answer_lengths``.
        packed: micro-batches are filled to a token budget (``micro_batch_size`` rows of the
            priced length each), so their activations are sized at the priced length; False:
            padded rows, sized at the full length.
        stop_check_interval: decode steps between the engine's checks for ended answers
            (``generation.stop_check_interval``): an ended answer holds its slot until the next
            one. Only priced with ``answer_lengths``.
        partial_rollouts: with ``overlap``, the shadows take the trained weights mid-round
            (``rollout.partial_rollouts``); priced as one step off (``planner.asynchronous``).
        continue_answers: with ``overlap``, answers go on across steps
            (``rollout.continue_answers``): a step's generation is priced as a replica whose
            slots stay full (``asynchronous.pool_steady_state``), not as its round.
        reuse_logprobs: the old log-probs are generation's
            (``rollout.reuse_generation_logprobs``, which partial rollouts need): no experience
            forward of the generating policy.
        proximal_forward: the actor runs one more forward over the step's rows before its
            first update (``algorithm.off_policy`` ``decoupled`` or ``truncated_is``).
    """

    batch: int = 512
    prompt_length: int = 256
    generation_length: int = 256
    ppo_epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int = 4
    activation_checkpointing: bool = False
    overlap: bool = True
    answer_lengths: AnswerLengths | None = None
    batching: str = "continuous"
    packed: bool = False
    stop_check_interval: int = 1
    partial_rollouts: bool = False
    continue_answers: bool = False
    reuse_logprobs: bool = False
    proximal_forward: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_length", "generation_length", "ppo_epochs",
                     "num_minibatches", "micro_batch_size", "stop_check_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name}={value!r} must be an integer >= 1")
        if self.batch % self.num_minibatches:
            raise ValueError(
                f"rollout.batch({self.batch}) is not a multiple of num_minibatches"
                f"({self.num_minibatches}): change one of them"
            )
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"rollout batching={self.batching!r} must be 'continuous' or "
                             "'static' (generation.batching)")
        lengths = self.answer_lengths
        if lengths is not None and lengths.cap != self.generation_length:
            raise ValueError(f"answer lengths are cut at {lengths.cap} tokens but "
                             f"generation_length is {self.generation_length}: build them with "
                             "cap=generation_length (generation.max_new_tokens)")
        if self.continue_answers and not self.partial_rollouts:
            raise ValueError("rollout continue_answers needs partial_rollouts (as "
                             "rollout.continue_answers does): set both")

    @property
    def sequence_length(self) -> int:
        """Tokens of one sample: prompt plus response."""
        return self.prompt_length + self.generation_length

    @property
    def mean_answer_length(self) -> float:
        """Mean answer tokens: the distribution's mean, else ``generation_length``."""
        lengths = self.answer_lengths
        return lengths.mean if lengths is not None else float(self.generation_length)

    @property
    def priced_sequence_length(self) -> int:
        """Tokens of one sample as the experience and training passes are priced: prompt plus
        the mean answer (a packed micro-batch holds the answers' tokens, not their cap)."""
        return self.prompt_length + max(1, round(self.mean_answer_length))

    @property
    def activation_sequence_length(self) -> int:
        """Tokens per row that a micro-batch's activations are sized for: the priced length
        when packed, else the full length (a padded row may hold the longest answer)."""
        return self.priced_sequence_length if self.packed else self.sequence_length

    def with_answer_lengths(self, lengths: AnswerLengths | None) -> RolloutSpec:
        """These shapes with ``lengths`` (its cap becomes ``generation_length``)."""
        if lengths is None:
            return replace(self, answer_lengths=None)
        return replace(self, generation_length=lengths.cap, answer_lengths=lengths)

    @classmethod
    def from_run_config(cls, run: Any, activation_checkpointing: bool = False,
                        overlap: bool = True, proximal_forward: bool = False) -> RolloutSpec:
        """The shapes of a ``RunConfig`` (read by attribute, so the planner needs no engine).

        Args:
            run: an object with ``rollout`` (prompts_per_step, samples_per_prompt (default 1),
                max_prompt_length, micro_batch_size, ppo_epochs, num_minibatches, and if present
                partial_rollouts, continue_answers, reuse_generation_logprobs) and
                ``generation`` (max_new_tokens, batching, stop_check_interval), such as
                ``megatron_rlhf.config.ppo_run.RunConfig``.
            activation_checkpointing: whether the trainers recompute activations.
            overlap: see ``RolloutSpec.overlap``.
            proximal_forward: see ``RolloutSpec.proximal_forward`` (the caller knows the
                off-policy registry; the planner does not import it).
        """
        rollout, generation = run.rollout, run.generation
        rows = rollout.prompts_per_step * getattr(rollout, "samples_per_prompt", 1)
        return cls(batch=rows, prompt_length=rollout.max_prompt_length,
                   generation_length=max(generation.max_new_tokens, 1),
                   ppo_epochs=rollout.ppo_epochs, num_minibatches=rollout.num_minibatches,
                   micro_batch_size=rollout.micro_batch_size,
                   activation_checkpointing=activation_checkpointing, overlap=overlap,
                   batching=getattr(generation, "batching", "continuous"),
                   stop_check_interval=getattr(generation, "stop_check_interval", 1),
                   partial_rollouts=getattr(rollout, "partial_rollouts", False),
                   continue_answers=getattr(rollout, "continue_answers", False),
                   reuse_logprobs=getattr(rollout, "reuse_generation_logprobs", False),
                   proximal_forward=proximal_forward)

    def to_dict(self) -> dict:
        """JSON-ready description (the length distribution as its summary)."""
        values = asdict(self)
        lengths = self.answer_lengths
        values["answer_lengths"] = lengths.to_dict() if lengths is not None else None
        return values
