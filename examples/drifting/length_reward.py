"""A reward that favours longer answers, for a workload whose answers grow while it trains
(examples/drifting/drifting_lengths.yaml; on ``PYTHONPATH`` as a user's module):

    reward:
      functions:
        - {name: "length_reward:length_reward", weight: 1.0, target: 64}
"""

from __future__ import annotations

from typing import Any


def length_reward(prompt: str, response: str, record: dict[str, Any], target: int = 64) -> float:
    """``min(len(response), target) / target``: 0 for an empty answer, 1 from ``target``
    characters on (the arithmetic tokenizer spends about one token per character).

    Raises:
        ValueError: ``target`` is not positive.
    """
    if target <= 0:
        raise ValueError(f"length_reward target ({target}) must be positive")
    return min(len(response.strip()), target) / target
