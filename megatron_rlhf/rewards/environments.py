"""Environments a multi-turn rollout talks to: one instance per episode, on the generating rank.

    spec = parse_environment({"name": "my_envs:Guess", "kwargs": {"tries": 3},
                              "timeout_s": 60, "on_error": "error"})
    env = spec.make(record)          # Guess(record, tries=3)
    first = env.reset()              # the first user message, or None: the record's prompt
    observation, reward, done = env.step(reply_text)

The observation becomes the next user message (None ends the episode); the episode's reward is
the sum of its step rewards plus whatever the reward functions or the reward model give the
final transcript. An environment keeps state between calls, so it runs in the rank's own process
(not in the reward functions' worker pool). A call (constructing it, ``reset``, ``step``) that
raises, runs past ``timeout_s`` (an alarm interrupts it, as the tools' timeout does in their
workers) or returns anything else fails with :class:`EnvironmentError_` naming the class, the
call and the record; ``on_error`` says what then happens: ``error`` stops the run, ``end`` ends
that episode there (the caller counts it).
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rlhf.rewards.functions import import_function
from megatron_rlhf.rewards.pool import UserCodeError, _excerpt, raised_at

ENVIRONMENT_ON_ERROR = ("error", "end")
"""``rollout.environment.on_error``: a failed call stops the run, or ends its episode."""


class EnvironmentError_(UserCodeError):  # noqa: N801 - ``EnvironmentError`` is a builtin alias
    """An environment's call failed."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """A checked ``rollout.environment``.

    Attributes:
        target: ``package.module:Class``.
        kwargs: keyword arguments of every instance.
        timeout_s: the longest one call (constructing, ``reset``, ``step``) may run, seconds.
        on_error: ``error`` or ``end`` (module docstring).
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0
    on_error: str = "error"

    def make(self, record: Mapping[str, Any], index: int = -1) -> Episode:
        """A new environment for one episode of the prompt ``record`` (``index``: its index in
        the prompt set, for messages)."""
        where = f"rollout.environment {self.target!r} on prompt record #{index}"
        env = _called(lambda: import_function(self.target)(record, **self.kwargs),
                      f"{where}: constructing it", record, self.timeout_s)
        return Episode(env, where, record, self.timeout_s)


def parse_environment(entry: Mapping[str, Any]) -> EnvironmentSpec:
    """Check ``rollout.environment``.

    Raises:
        ValueError: not ``{name: ..., kwargs: {...}, timeout_s: ..., on_error: ...}``, a
            timeout that is not a positive number, an unknown ``on_error``, a class that does
            not import or has no ``reset`` and ``step``.
    """
    if (not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str)
            or set(entry) - {"name", "kwargs", "timeout_s", "on_error"}
            or not isinstance(entry.get("kwargs", {}), Mapping)):
        raise ValueError(f"rollout.environment={entry!r} must be a mapping {{name: "
                         "'package.module:Class', kwargs: {...}, timeout_s: 60, on_error: "
                         "error}} (all but name optional)")
    timeout_s = entry.get("timeout_s", EnvironmentSpec.timeout_s)
    if (not isinstance(timeout_s, numbers.Real) or isinstance(timeout_s, bool)
            or not 0 < timeout_s < math.inf):
        raise ValueError(f"rollout.environment.timeout_s={timeout_s!r} must be a number of "
                         "seconds > 0")
    on_error = entry.get("on_error", EnvironmentSpec.on_error)
    if on_error not in ENVIRONMENT_ON_ERROR:
        raise ValueError(f"rollout.environment.on_error={on_error!r}: use one of "
                         f"{ENVIRONMENT_ON_ERROR} (stop the run, or end the episode)")
    cls = import_function(entry["name"], "rollout.environment")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"rollout.environment.name={entry['name']!r} has no method "
                         f"{missing}: an environment is Class(record, **kwargs) with reset() -> "
                         "str | None and step(response) -> (observation, reward, done)")
    return EnvironmentSpec(entry["name"], dict(entry.get("kwargs") or {}), float(timeout_s),
                           on_error)


class _Timeout(BaseException):
    """The alarm of :func:`_within` went off (not an ``Exception``: an environment's own
    ``except Exception`` does not swallow it)."""


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _within(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()``, interrupted by :class:`_Timeout` after ``timeout_s``. On the main thread an
    alarm interrupts it (an alarm already set, pytest-timeout's for one, is put back with the
    time it has left); elsewhere it runs on a daemon thread that is abandoned when late."""
    if threading.current_thread() is not threading.main_thread():
        box: list[Any] = []
        thread = threading.Thread(target=lambda: box.append(_outcome(call)), daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not box:
            raise _Timeout
        ok, value = box[0]
        if not ok:
            raise value
        return value
    previous = signal.signal(signal.SIGALRM, _alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL,
                             max(outer - (time.monotonic() - start), 1e-3))


def _outcome(call: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, call()
    except Exception as error:  # noqa: BLE001 - re-raised by the caller
        return False, error


def _called(call: Callable[[], Any], what: str, record: Mapping[str, Any],
            timeout_s: float) -> Any:
    try:
        return _within(call, timeout_s)
    except _Timeout:
        raise EnvironmentError_(f"{what} ran past its timeout of {timeout_s} s "
                                "(rollout.environment.timeout_s) "
                                f"({_excerpt(record)})") from None
    except Exception as error:  # noqa: BLE001 - the user's environment may raise anything
        at = raised_at(error)
        raise EnvironmentError_(f"{what} raised {type(error).__name__}: {error} "
                                f"({_excerpt(record)}){f'; raised at {at}' if at else ''}"
                                ) from error


@dataclass
class Episode:
    """One episode's environment, its calls checked."""

    env: Any
    where: str
    record: Mapping[str, Any]
    timeout_s: float = 60.0

    def reset(self) -> str | None:
        """The first user message, or None (the record's prompt)."""
        first = _called(self.env.reset, f"{self.where}: reset()", self.record, self.timeout_s)
        if first is not None and not isinstance(first, str):
            raise EnvironmentError_(f"{self.where}: reset() returned {first!r:.60}, not a str "
                                    "or None")
        return first

    def step(self, response: str) -> tuple[str | None, float, bool]:
        """``(observation, reward, done)`` of one reply."""
        result = _called(lambda: self.env.step(response), f"{self.where}: step()", self.record,
                         self.timeout_s)
        ok = (isinstance(result, tuple) and len(result) == 3
              and (result[0] is None or isinstance(result[0], str))
              and isinstance(result[1], numbers.Real) and math.isfinite(result[1]))
        if not ok:
            raise EnvironmentError_(f"{self.where}: step() returned {result!r:.80}; it must "
                                    "return (observation: str | None, reward: finite number, "
                                    "done: bool)")
        observation, reward, done = result
        return observation, float(reward), bool(done)
