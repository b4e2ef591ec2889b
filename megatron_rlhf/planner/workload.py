"""What one PPO step does, in the shapes the cost model needs.

    rollout = RolloutSpec(batch=1024, prompt_length=256, generation_length=256)
    rollout = RolloutSpec.from_run_config(run_config)   # a RunConfig, read by attribute

Every sequence is taken at full length (``prompt_length + generation_length``): generation is
priced as if no sequence stopped early, which is what a step costs when responses reach
``max_new_tokens`` (an upper bound otherwise).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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
    """

    batch: int = 512
    prompt_length: int = 256
    generation_length: int = 256
    ppo_epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int = 4
    activation_checkpointing: bool = False
    overlap: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_length", "generation_length", "ppo_epochs",
                     "num_minibatches", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name}={value!r} must be an integer >= 1")
        if self.batch % self.num_minibatches:
            raise ValueError(
                f"rollout.batch({self.batch}) is not a multiple of num_minibatches"
                f"({self.num_minibatches}): change one of them"
            )

    @property
    def sequence_length(self) -> int:
        """Tokens of one sample: prompt plus response."""
        return self.prompt_length + self.generation_length

    @classmethod
    def from_run_config(cls, run: Any, activation_checkpointing: bool = False,
                        overlap: bool = True) -> RolloutSpec:
        """The shapes of a ``RunConfig`` (read by attribute, so the planner needs no engine).

        Args:
            run: an object with ``rollout`` (prompts_per_step, samples_per_prompt (default 1),
                max_prompt_length, micro_batch_size, ppo_epochs, num_minibatches) and ``generation``
                (max_new_tokens), such as ``megatron_rlhf.config.ppo_run.RunConfig``.
            activation_checkpointing: whether the trainers recompute activations.
            overlap: see ``RolloutSpec.overlap``.
        """
        rollout, generation = run.rollout, run.generation
        rows = rollout.prompts_per_step * getattr(rollout, "samples_per_prompt", 1)
        return cls(batch=rows, prompt_length=rollout.max_prompt_length,
                   generation_length=max(generation.max_new_tokens, 1),
                   ppo_epochs=rollout.ppo_epochs, num_minibatches=rollout.num_minibatches,
                   micro_batch_size=rollout.micro_batch_size,
                   activation_checkpointing=activation_checkpointing, overlap=overlap)

    def to_dict(self) -> dict:
        """JSON-ready description."""
        return asdict(self)
