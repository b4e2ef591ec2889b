"""Environments a multi-turn rollout talks to: one instance per episode, on the generating rank.

    spec = parse_environment({"name": "my_envs:Guess", "kwargs": {"tries": 3}})
    env = spec.make(record)          # Guess(record, tries=3)
    first = env.reset()              # the first user message, or None: the record's prompt
    observation, reward, done = env.step(reply_text)

The observation becomes the next user message (None ends the episode); the episode's reward is
the sum of its step rewards plus whatever the reward functions or the reward model give the
final transcript. An environment keeps state between calls, so it runs in the rank's own process
(not in the reward functions' worker pool); a call that raises or returns anything else stops the
run with :class:`EnvironmentError_` naming the class, the call and the record.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rlhf.rewards.functions import import_function
from megatron_rlhf.rewards.pool import _excerpt


class EnvironmentError_(RuntimeError):  # noqa: N801 - ``EnvironmentError`` is a builtin alias
    """An environment's call failed."""

    local_cause = True


@dataclass(frozen=True)
class EnvironmentSpec:
    """A checked ``rollout.environment``.

    Attributes:
        target: ``package.module:Class``.
        kwargs: keyword arguments of every instance.
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make(self, record: Mapping[str, Any], index: int = -1) -> Episode:
        """A new environment for one episode of the prompt ``record`` (``index``: its index in
        the prompt set, for messages)."""
        where = f"rollout.environment {self.target!r} on prompt record #{index}"
        return Episode(_called(lambda: import_function(self.target)(record, **self.kwargs),
                               f"{where}: constructing it", record), where, record)


def parse_environment(entry: Mapping[str, Any]) -> EnvironmentSpec:
    """Check ``rollout.environment``.

    Raises:
        ValueError: not ``{name: ..., kwargs: {...}}``, a class that does not import or has no
            ``reset`` and ``step``.
    """
    if (not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str)
            or set(entry) - {"name", "kwargs"} or not isinstance(entry.get("kwargs", {}),
                                                                 Mapping)):
        raise ValueError(f"rollout.environment={entry!r} must be a mapping {{name: "
                         "'package.module:Class', kwargs: {...}}} (kwargs optional)")
    cls = import_function(entry["name"], "rollout.environment")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"rollout.environment.name={entry['name']!r} has no method "
                         f"{missing}: an environment is Class(record, **kwargs) with reset() -> "
                         "str | None and step(response) -> (observation, reward, done)")
    return EnvironmentSpec(entry["name"], dict(entry.get("kwargs") or {}))


def _called(call: Any, what: str, record: Mapping[str, Any]) -> Any:
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - the user's environment may raise anything
        raise EnvironmentError_(f"{what} raised {type(error).__name__}: {error} "
                                f"({_excerpt(record)})") from error


@dataclass
class Episode:
    """One episode's environment, its calls checked."""

    env: Any
    where: str
    record: Mapping[str, Any]

    def reset(self) -> str | None:
        """The first user message, or None (the record's prompt)."""
        first = _called(self.env.reset, f"{self.where}: reset()", self.record)
        if first is not None and not isinstance(first, str):
            raise EnvironmentError_(f"{self.where}: reset() returned {first!r:.60}, not a str "
                                    "or None")
        return first

    def step(self, response: str) -> tuple[str | None, float, bool]:
        """``(observation, reward, done)`` of one reply."""
        result = _called(lambda: self.env.step(response), f"{self.where}: step()", self.record)
        ok = (isinstance(result, tuple) and len(result) == 3
              and (result[0] is None or isinstance(result[0], str))
              and isinstance(result[1], numbers.Real) and math.isfinite(result[1]))
        if not ok:
            raise EnvironmentError_(f"{self.where}: step() returned {result!r:.80}; it must "
                                    "return (observation: str | None, reward: finite number, "
                                    "done: bool)")
        observation, reward, done = result
        return observation, float(reward), bool(done)
