"""Environments as a user would write them, for the tests."""

from __future__ import annotations

import time
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


class Sleepy(Countdown):
    """A :class:`Countdown` whose ``step`` (record ``hang``) or ``reset`` (record
    ``hang_reset``) sleeps ``sleep_s`` seconds: an environment that hangs."""

    def __init__(self, record: dict[str, Any], sleep_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(record, **kwargs)
        self.sleep_s = sleep_s

    def reset(self) -> str | None:
        if self.record.get("hang_reset"):
            time.sleep(self.sleep_s)
        return super().reset()

    def step(self, response: str) -> tuple[str | None, float, bool]:
        if self.record.get("hang"):
            time.sleep(self.sleep_s)
        return super().step(response)
