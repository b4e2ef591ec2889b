"""Reward functions called in a pool of worker processes, with a per-call timeout.

    functions = RewardFunctions(specs, on_error="error", timeout_s=10.0, workers=4)
    scores = functions.score(prompts, responses, records)   # one call per row and function
    functions.close()                                         # always: the run's ``finally``

Each call ``function(prompt, response, record, **kwargs)`` runs in a worker process started
with ``spawn`` (the ranks of a run may be forked from a fork server or hold threads of their
own, which a forked worker must not inherit), so a slow function does not serialise the step and
one that crashes does not take the rank with it. A call must return a finite number, or a dict
of finite numbers with a ``"score"`` key: ``"score"`` is the function's score, weighted and
added to the sequence score; its other keys are logged as ``reward/<function>/<key>``.

A call that raises, runs past ``timeout_s`` or returns anything else is a failed call: with
``on_error="error"`` :class:`RewardFunctionError` names the function, the record (its index in
the prompt set and an excerpt), what went wrong and the file:line that raised; with ``"zero"`` it scores 0 and is counted in
``reward/errors``. The worker enforces the timeout with an interval timer; a call stuck where
the timer cannot interrupt it (inside a C extension) is caught by the pool's own deadline, after
which the pool's processes are terminated and the calls after it run on new ones.

The workers belong to the rank, which alone decides when they stop: each ignores SIGTERM and
SIGINT and runs in a process group of its own, so the SIGTERM that torchrun's agent (or a
terminal's Ctrl-C) sends to the whole group on preemption reaches the rank, which finishes its
step and saves, while its reward calls go on. A worker whose rank is gone exits by itself.
:meth:`RewardFunctions.close` stops them with SIGKILL and never waits on a dead worker for
longer than ``_CLOSE_S`` (a worker killed from outside may die holding the pool's queue lock,
on which ``Pool.terminate`` would wait forever).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import multiprocessing.pool
import numbers
import os
import signal
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rlhf.rewards.functions import ON_ERROR_POLICIES, RewardFunctionSpec, import_function

SCORE_KEY = "score"
"""The key of a dict-valued result that is the function's score."""

_GRACE_S = 5.0
"""Slack of the pool's deadline beyond a worker's own timer (pickling, scheduling)."""

_START_S = 300.0
"""The longest new workers may take to start (importing the entry script again)."""

_CLOSE_S = 5.0
"""The longest :meth:`RewardFunctions.close` waits for the pool to wind down before it kills
what is left and moves on."""

_ORPHAN_CHECK_S = 1.0
"""How often a worker checks that its rank is still there."""

_EXCERPT_CHARS = 120

_imported: dict[str, Callable[..., Any]] = {}
"""The worker's imported functions, by target."""


class UserCodeError(RuntimeError):
    """A user's reward function, tool or environment failed and the run stops; the message names
    it, the record, what went wrong and, when it raised, where in the user's code.

    Its cause is on the rank that raised it, even when its text says "timeout": the run's fault
    tracker reports it as that rank's own failure, in full, not as a collective's. An entry
    point prints its message as one line: a traceback through the library would bury it.
    """

    local_cause = True


class RewardFunctionError(UserCodeError):
    """A reward function failed on a record with ``reward.on_error=error``."""


@dataclass(frozen=True)
class Raised:
    """What a user's call raised: ``why`` (``raised ValueError: ...``, its text) and ``at``, the
    ``file:line`` in the user's code that raised it ("" when unknown)."""

    why: str
    at: str = ""

    def __str__(self) -> str:
        return self.why


_LIBRARY_DIRS = tuple(os.path.join(path, "") for path in
                      {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
                      | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
"""Code that is not the user's: Python's, the installed packages' and this package's."""


def raised_at(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in the user's code (outside
    :data:`_LIBRARY_DIRS`), else of its innermost frame; "" without a traceback. A file under the
    working directory is named relative to it."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = next((f for f in reversed(frames)
                  if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)), frames[-1])
    path = os.path.abspath(frame.filename)
    cwd = os.getcwd() + os.sep
    return f"{path[len(cwd):] if path.startswith(cwd) else path}:{frame.lineno}"


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _not_a_number(value: Any) -> str | None:
    """Why ``value`` is not a finite number, or None."""
    if not isinstance(value, numbers.Real):  # bools count as 0 and 1
        return f"{type(value).__name__} {value!r:.60}, not a number"
    if not math.isfinite(value):
        return f"{value}, not a finite number"
    return None


def _checked(value: Any) -> tuple[str, Any]:
    """``("ok", score)`` for a finite number, ``("ok", dict)`` for a dict of them with
    ``"score"``, else ``("bad", why)``."""
    if isinstance(value, Mapping):
        if SCORE_KEY not in value:
            return "bad", f"returned a dict without a {SCORE_KEY!r} key: {sorted(value)}"
        for key, item in value.items():
            why = _not_a_number(item)
            if why is not None:
                return "bad", f"returned {{{key!r}: {why}}}"
        return "ok", {str(key): float(item) for key, item in value.items()}
    why = _not_a_number(value)
    return ("bad", f"returned {why}") if why is not None else ("ok", float(value))


def _worker_init(parent: int) -> None:
    """A worker's setup: deaf to the job's SIGTERM and SIGINT (the rank stops it), in a process
    group of its own, and gone once its rank is."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgrp()

    def exit_with_the_rank() -> None:
        while os.getppid() == parent:
            time.sleep(_ORPHAN_CHECK_S)
        os._exit(1)

    threading.Thread(target=exit_with_the_rank, name="reward-worker-orphan-watch",
                     daemon=True).start()


def _in_own_group(pid: int | None) -> bool:
    """Whether the worker ``pid`` has run :func:`_worker_init` (its own process group)."""
    try:
        return pid is not None and os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


class _Worker(mp.get_context("spawn").Process):  # type: ignore[misc, name-defined]
    """A pool worker that ``Pool.terminate`` stops with SIGKILL: it ignores SIGTERM."""

    def terminate(self) -> None:
        self.kill()


class _Pool(multiprocessing.pool.Pool):
    """A spawn pool of :class:`_Worker` processes."""

    @staticmethod
    def Process(ctx: Any, *args: Any, **kwds: Any) -> _Worker:  # noqa: N802 - Pool's hook
        return _Worker(*args, **kwds)


def _ready() -> None:
    """A call that returns once a worker runs it."""


def _call(target: str, prompt: str, response: str, record: Mapping[str, Any],
          kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """Run one call in a worker: ``("ok", float | dict)``, ``("bad", why)``, ``("raised", why)``
    or ``("timeout", why)``."""
    if target not in _imported:
        _imported[target] = import_function(target)
    status, value = timed_call(_imported[target], (prompt, response, record), kwargs, timeout_s,
                               "reward.timeout_s")
    return _checked(value) if status == "ok" else (status, value)


def timed_call(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
               timeout_s: float, setting: str) -> tuple[str, Any]:
    """``function(*args, **kwargs)`` in a worker, stopped by an alarm after ``timeout_s``:
    ``("ok", value)``, ``("timeout", why)`` naming ``setting``, or ``("raised", Raised)``."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return "ok", function(*args, **kwargs)
    except _Timeout:
        return "timeout", f"ran past its timeout of {timeout_s} s ({setting})"
    except Exception as error:  # noqa: BLE001 - the user's function may raise anything
        return "raised", Raised(f"raised {type(error).__name__}: {error}", raised_at(error))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class RewardScores:
    """The scores of a batch of rows.

    Attributes:
        scores: ``[rows][functions]`` each function's unweighted score (0 for a failed call).
        errors: ``[rows]`` failed calls of each row (``on_error="zero"``).
        extras: ``reward/<function>/<key>`` -> the values of a dict result's other keys.
        first_error: what the first failed call did, naming the function and the record
            (``on_error="zero"``); empty when none failed.
    """

    scores: list[list[float]]
    errors: list[int]
    extras: dict[str, list[float]] = field(default_factory=dict)
    first_error: str = ""


class RewardFunctions:
    """The configured reward functions and the worker pool that runs them.

    Args:
        specs: the checked ``reward.functions``.
        on_error: ``error`` or ``zero`` (see the module docstring).
        timeout_s: the longest one call may run.
        workers: worker processes (started at the first :meth:`score`, on the ranks that score).
        timeout_field: the setting a lost call's message names (the tools' pool names
            ``rollout.tool_timeout_s``).

    Raises:
        ValueError: an unknown ``on_error``, or a timeout or worker count that is not positive.
    """

    def __init__(self, specs: Sequence[RewardFunctionSpec], on_error: str = "error",
                 timeout_s: float = 10.0, workers: int = 2,
                 timeout_field: str = "reward.timeout_s") -> None:
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"reward.on_error={on_error!r}: use one of {ON_ERROR_POLICIES}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        if workers < 1:
            raise ValueError(f"reward.workers={workers} must be >= 1")
        self.specs = list(specs)
        self.on_error = on_error
        self.timeout_s = float(timeout_s)
        self.workers = workers
        self.timeout_field = timeout_field
        self._pool: Any = None

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              records: Sequence[tuple[int, Mapping[str, Any]]]) -> RewardScores:
        """Call every function on every row.

        Args:
            prompts: each row's prompt text.
            responses: each row's decoded response.
            records: each row's ``(index in the prompt set, record)``.

        Raises:
            RewardFunctionError: the first failed call in row order, with ``on_error="error"``.
        """
        if not self.specs or not prompts:
            return RewardScores([[] for _ in prompts], [0] * len(prompts))
        calls = [(spec.target, prompt, response, record, spec.kwargs, self.timeout_s)
                 for prompt, response, (_, record) in zip(prompts, responses, records,
                                                          strict=True)
                 for spec in self.specs]
        flat = self.run_calls(_call, calls)
        k = len(self.specs)
        return self._collect([flat[i:i + k] for i in range(0, len(flat), k)], records)

    def run_calls(self, entry: Callable[..., tuple[str, Any]], calls: list[tuple]
                  ) -> list[tuple[str, Any]]:
        """Every call's outcome, in order: ``entry(*call)`` run in the workers (a module-level
        function, ``("status", value)`` back; the tools of multi-turn rollouts use it too).

        Calls are collected in submission order; as the pool starts them in that order, each
        one is due within ``timeout_s`` (plus slack) of the one before it. One that is not has a
        worker stuck where its timer cannot reach: the pool is stopped, and the calls after it
        start again on new workers (a call may then run twice; keep functions pure).
        """
        outcomes: list[tuple[str, Any]] = []
        while len(outcomes) < len(calls):
            pending = [self.submit_call(entry, call) for call in calls[len(outcomes):]]
            last = time.monotonic()
            for result in pending:
                outcomes.append(self.outcome(result, self.due(last)))
                if outcomes[-1][0] == "lost":
                    self.close()
                    break
                last = time.monotonic()
        return outcomes

    def submit_call(self, entry: Callable[..., tuple[str, Any]], call: tuple,
                    on_back: Callable[[], None] | None = None
                    ) -> multiprocessing.pool.AsyncResult:
        """Start ``entry(*call)`` in the workers (starting them first if they are not running)
        and return at once; :meth:`outcome` reads the result. Not thread-safe: submit, read and
        :meth:`close` from one thread.

        Args:
            on_back: called, in the pool's result thread, as the result (or its error) comes
                back, before the result reads ready.
        """
        if self._pool is None:
            self._start()
        if on_back is None:
            return self._pool.apply_async(entry, call)
        return self._pool.apply_async(entry, call, callback=lambda _: on_back(),
                                      error_callback=lambda _: on_back())

    def _start(self) -> None:
        """Start the workers and wait until every one has run its setup (spawned workers import
        the entry script again: that time is not any call's; and a worker still starting is in
        the rank's process group, where the job's SIGTERM would reach it)."""
        self._pool = _Pool(self.workers, initializer=_worker_init, initargs=(os.getpid(),),
                           context=mp.get_context("spawn"))
        deadline = time.monotonic() + _START_S
        try:
            self._pool.apply_async(_ready).get(_START_S)
            while not all(_in_own_group(worker.pid) for worker in self._pool._pool):
                if time.monotonic() > deadline:
                    raise mp.TimeoutError
                time.sleep(0.01)
        except mp.TimeoutError as error:
            self.close()
            raise RewardFunctionError(
                f"the reward function workers did not start within {_START_S:.0f} s; a worker "
                "imports the run's entry script again: check that it imports without side "
                "effects and keeps its work behind `if __name__ == \"__main__\":`") from error

    def due(self, since: float) -> float:
        """The deadline of a call that a worker may run from ``since`` on (``time.monotonic()``):
        its timeout, and slack for pickling and scheduling."""
        return since + self.timeout_s + _GRACE_S

    def outcome(self, result: Any, deadline: float) -> tuple[str, Any]:
        """The outcome of a submitted call, waiting for it until ``deadline``
        (``time.monotonic()``); ``("lost", why)`` when it is not back by then or its worker
        failed (the caller stops the pool: :meth:`close`)."""
        try:
            return result.get(max(0.0, deadline - time.monotonic()))
        except mp.TimeoutError:
            return "lost", (f"ran past its timeout of {self.timeout_s} s ({self.timeout_field}) "
                            "and could not be interrupted; its worker was stopped")
        except Exception as error:  # noqa: BLE001 - a worker that died, unpicklable results
            return "lost", f"failed in its worker process ({type(error).__name__}: {error})"

    def _collect(self, outcomes: list[list[tuple[str, Any]]],
                 records: Sequence[tuple[int, Mapping[str, Any]]]) -> RewardScores:
        result = RewardScores([], [])
        for row, (index, record) in zip(outcomes, records, strict=True):
            scores, errors = [], 0
            for spec, (status, value) in zip(self.specs, row, strict=True):
                if status != "ok":
                    failure = (f"reward function {spec.target!r} {value} on prompt record "
                               f"#{index} ({_excerpt(record)})")
                    if self.on_error == "error":
                        at = getattr(value, "at", "")
                        raise RewardFunctionError(
                            f"{failure}{f'; raised at {at}' if at else ''}; fix the function, or "
                            "set reward.on_error=zero to score such calls 0 and count them in "
                            "reward/errors")
                    result.first_error = result.first_error or failure
                    scores.append(0.0)
                    errors += 1
                    continue
                if isinstance(value, dict):
                    for key, item in value.items():
                        if key != SCORE_KEY:
                            result.extras.setdefault(f"{spec.metric}/{key}", []).append(item)
                    value = value[SCORE_KEY]
                scores.append(value)
            result.scores.append(scores)
            result.errors.append(errors)
        return result

    def close(self) -> None:
        """Stop the worker processes (a later :meth:`score` starts new ones); returns within
        about ``2 * _CLOSE_S`` seconds even when a worker died holding the pool's queue lock."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        stopper = threading.Thread(target=pool.terminate, name="reward-pool-terminate",
                                   daemon=True)
        stopper.start()
        stopper.join(_CLOSE_S)
        workers = list(pool._pool)  # noqa: SLF001 - the processes, to kill what is left
        for worker in workers:
            if worker.exitcode is None:
                worker.kill()
        for worker in workers:
            worker.join(_CLOSE_S)
        if stopper.is_alive():
            # A worker died holding the pool's queue lock: its handler threads (daemons) are
            # abandoned; the processes are gone.
            stopper.join(0.1)


def _excerpt(record: Mapping[str, Any]) -> str:
    text = json.dumps(record, ensure_ascii=False, default=str)
    return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "..."
