"""Environments as a user would write them, for the tests."""

from __future__ import annotations

from typing import Any


class Countdown:
    """Answers every reply with how many replies are left; done after ``replies``. Each reply
    earns ``reward``; ``opening``: the first user message instead of the record's prompt."""

    def __init__(self, record: dict[str, Any], replies: int = 2, reward: float = 0.5,
                 opening: str | None = None) -> None:
        self.left = replies
        self.reward = reward
        self.opening = opening
        self.record = record

    def reset(self) -> str | None:
        return self.opening

    def step(self, response: str) -> tuple[str | None, float, bool]:
        self.left -= 1
        if self.record.get("explode"):
            raise RuntimeError("the board caught fire")
        return f"left {self.left}", self.reward, self.left == 0


class NoStep:
    def __init__(self, record: dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        return None
