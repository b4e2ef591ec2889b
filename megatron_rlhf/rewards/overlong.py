"""DAPO's overlong penalty on the generated token counts of a batch (``reward.overlong_buffer``).

Kept apart from ``verifiers.py``, which the reward-function workers import without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlhf.rewards.verifiers import overlong_penalty


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's overlong penalty of responses by their generated token counts
    (``reward.overlong_buffer``): the budget ``max_length`` is ``generation.max_new_tokens``."""

    max_length: int
    buffer_length: int
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        overlong_penalty(0, self.max_length, self.buffer_length)  # refuses a bad buffer

    def __call__(self, response_mask: torch.Tensor) -> torch.Tensor:
        """The penalty ``[B]`` (float32) of each row of a ``[B, R]`` response mask."""
        lengths = response_mask.sum(dim=-1).tolist()
        return torch.tensor([overlong_penalty(int(length), self.max_length, self.buffer_length,
                                              self.penalty_factor) for length in lengths],
                            dtype=torch.float32, device=response_mask.device)
