"""An environment that answers every reply (``rollout.environment``), so that every episode of
the GPU check's multi-turn part takes all of ``rollout.max_turns`` turns whatever a random tiny
policy writes (docs/howto/train-an-agent.md, "An environment instead of tools").

    PYTHONPATH=scripts torchrun --nproc-per-node 1 tools/run_ppo.py --steps 2 \
        'rollout.environment={name: gpu_check_env:Retry}' rollout.max_turns=3 \
        rollout.max_episode_tokens=48
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Retry:
    """Asks for another reply until the episode has had ``turns`` replies; each reply that
    repeats a character of the record's prompt earns a little, so the rewards vary.

    Args:
        record: the prompt's data record (unused beyond its prompt).
        turns: replies before the episode ends (the run's ``max_turns`` bounds it too).
    """

    def __init__(self, record: Mapping[str, Any], turns: int = 3) -> None:
        self.prompt = str(record.get("prompt", ""))
        self.turns = turns

    def reset(self) -> str | None:
        """None: the record's own prompt opens the episode."""
        return None

    def step(self, response: str) -> tuple[str | None, float, bool]:
        """The next user message, this reply's reward and whether the episode is done."""
        self.turns -= 1
        reward = 0.1 * sum(char in self.prompt for char in set(response[:8]))
        return "Again.", reward, self.turns <= 0
