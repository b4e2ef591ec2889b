"""Tools the policy calls during a rollout, run in the reward functions' worker pool.

    tools = Tools(parse_tools([{"name": "my_tools:calculator"}]), on_error="observe",
                  timeout_s=10.0, workers=2)
    answers = tools.call([ToolCall(text, record, index), ...])   # one answer per call
    pending = tools.submit(ToolCall(text, record, index))         # returns at once
    answer = pending.answer(wait=True)                            # as call() answers it
    tools.close()

A tool is ``function(arguments: dict, record: dict, **kwargs) -> str``; the policy calls it by
the function's name, writing ``<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>``
(the format Qwen2.5's and Llama-3.1's chat templates render tools in). A call goes wrong in one of
these ways: the text between the tags is not JSON, not an object with a ``name`` and an object
``arguments``, names no configured tool, or the tool raises (wrong arguments included), runs past
``timeout_s`` or returns something other than a string. With ``on_error="observe"`` the policy
reads a one-line error instead of an answer (counted in ``rollout/tool_errors``); with ``"error"``
:class:`ToolError` stops the run, naming the tool, the call and the record.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rlhf.rewards.functions import import_function
from megatron_rlhf.rewards.pool import RewardFunctions, UserCodeError, _excerpt, timed_call

TOOL_ON_ERROR = ("observe", "error")
"""``rollout.tool_on_error``: the error becomes the policy's observation, or the run stops."""

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The tags around a tool call in the policy's text."""

_imported: dict[str, Callable[..., Any]] = {}
"""The worker's imported tools, by target."""


class ToolError(UserCodeError):
    """A tool call failed with ``rollout.tool_on_error=error``."""


@dataclass(frozen=True)
class ToolSpec:
    """A checked ``rollout.tools`` entry.

    Attributes:
        target: ``package.module:function``.
        kwargs: keyword arguments of every call (the entry's ``kwargs``).
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The name the policy calls the tool by: the function's own name."""
        return self.target.rpartition(":")[2].rpartition(".")[2]


def parse_tools(entries: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """Check ``rollout.tools`` and return one spec per entry.

    Raises:
        ValueError: an entry that is not ``{name: ..., kwargs: {...}}``, a tool that does not
            import, is not callable or cannot be called as ``tool(arguments, record,
            **kwargs)``, or two tools with one name; each names ``rollout.tools[i]``.
    """
    specs: list[ToolSpec] = []
    for index, entry in enumerate(entries):
        where = f"rollout.tools[{index}]"
        if (not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str)
                or set(entry) - {"name", "kwargs"}):
            raise ValueError(f"{where}={entry!r} must be a mapping {{name: "
                             "'package.module:function', kwargs: {...}}} (kwargs optional)")
        kwargs = entry.get("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"{where}.kwargs={kwargs!r} must be a mapping of keyword arguments")
        function = import_function(entry["name"], where)
        _check_signature(function, dict(kwargs), where, entry["name"])
        spec = ToolSpec(entry["name"], dict(kwargs))
        if any(spec.name == other.name for other in specs):
            raise ValueError(f"{where}.name={spec.target!r}: another tool is also called "
                             f"{spec.name!r}; the policy calls tools by function name, so give "
                             "one of them another name (a wrapper in your module)")
        specs.append(spec)
    return specs


def _check_signature(function: Callable[..., Any], kwargs: dict[str, Any], where: str,
                     target: str) -> None:
    """Refuse a tool that cannot be called as ``tool(arguments, record, **kwargs)``."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins without a signature: checked at the first call
        return
    try:
        signature.bind({}, {}, **kwargs)
    except TypeError as error:
        raise ValueError(f"{where}.name={target!r} cannot be called as tool(arguments, record"
                         f"{''.join(f', {k}=...' for k in sorted(kwargs))}) ({error}); a tool "
                         "takes the call's arguments (a dict) and the prompt's record (a dict), "
                         "then the entry's kwargs") from None


def parse_call(text: str) -> tuple[str, dict[str, Any]]:
    """``(tool name, arguments)`` of the last ``<tool_call>...</tool_call>`` in ``text``.

    Raises:
        ValueError: no closed call, or a call that is not ``{"name": str, "arguments": {}}``
            JSON; the message is what the policy reads back.
    """
    end = text.rfind(CALL_CLOSE)
    start = text.rfind(CALL_OPEN, 0, end)
    if end < 0 or start < 0:
        raise ValueError(f"no {CALL_OPEN}...{CALL_CLOSE} in the reply")
    body = text[start + len(CALL_OPEN):end].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        raise ValueError(f"the tool call is not JSON ({error.msg} at char {error.pos})") from None
    if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments", {}), dict)):
        raise ValueError('the tool call must be {"name": "<tool>", "arguments": {...}}')
    return call["name"], call.get("arguments", {})


def _tool_call(target: str, arguments: dict[str, Any], record: Mapping[str, Any],
               kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """Run one tool call in a worker: ``("ok", str)``, ``("bad", why)``, ``("raised", why)`` or
    ``("timeout", why)``."""
    if target not in _imported:
        _imported[target] = import_function(target, "rollout.tools")
    status, value = timed_call(_imported[target], (arguments, record), kwargs, timeout_s,
                               "rollout.tool_timeout_s")
    if status != "ok":
        return status, value
    if not isinstance(value, str):
        return "bad", f"returned {type(value).__name__} {value!r:.60}, not a string"
    return "ok", value


@dataclass(frozen=True)
class ToolCall:
    """One call the policy made: its reply's text (ending with the closing tag), and the
    prompt's record with its index in the prompt set."""

    text: str
    record: Mapping[str, Any]
    index: int = -1


@dataclass(frozen=True)
class ToolAnswer:
    """What the policy reads back, whether the call failed, and the seconds it took."""

    text: str
    failed: bool
    seconds: float


class Tools:
    """The configured tools and the worker pool that runs them.

    :meth:`call` answers a batch and returns; :meth:`submit` starts one call and returns at
    once, its :class:`PendingAnswer` read later (the overlapped episode loop). Either applies
    the same checks and ``on_error``; use one thread (the pool is not thread-safe).

    Args:
        specs: the checked ``rollout.tools``.
        on_error: ``observe`` or ``error`` (module docstring).
        timeout_s: the longest one call may run.
        workers: worker processes (started at the first call that reaches a tool).
    """

    def __init__(self, specs: Sequence[ToolSpec], on_error: str = "observe",
                 timeout_s: float = 10.0, workers: int = 2) -> None:
        if on_error not in TOOL_ON_ERROR:
            raise ValueError(f"rollout.tool_on_error={on_error!r}: use one of {TOOL_ON_ERROR}")
        self.specs = {spec.name: spec for spec in specs}
        self.on_error = on_error
        self.timeout_s = float(timeout_s)
        self._pool = RewardFunctions([], "error", timeout_s, workers,
                                     timeout_field="rollout.tool_timeout_s")
        self._flights: list[_Flight] = []
        """Submitted calls in submission order, from the oldest one not yet back."""

    def call(self, calls: Sequence[ToolCall]) -> list[ToolAnswer]:
        """Answer every call (the tools run concurrently in the pool), in order; each answer's
        ``seconds`` is the batch's wall time shared out over the calls that ran.

        Raises:
            ToolError: the first failed call, with ``on_error="error"``.
        """
        parsed = [self._parse(call) for call in calls]
        runs = [self._run(item, call) for item, call in zip(parsed, calls, strict=True)
                if not isinstance(item, str)]
        start = time.perf_counter()
        outcomes = iter(self._pool.run_calls(_tool_call, runs) if runs else [])
        seconds = (time.perf_counter() - start) / max(len(runs), 1)
        return [self._answer(call, item, None if isinstance(item, str) else next(outcomes),
                             seconds)
                for item, call in zip(parsed, calls, strict=True)]

    def submit(self, call: ToolCall) -> PendingAnswer:
        """Start ``call`` in the pool (a call that names no tool or is not JSON is answered at
        once) and return its pending answer; its ``seconds`` run from here to the moment the
        pool received its result (however late it is read). A call not back within its
        timeout (plus slack) of the moment the pool could start it (the calls before it were
        back) is lost, as in :meth:`call`: the pool is stopped, the answer is a failure, and
        the calls still out start again on new workers."""
        item = self._parse(call)
        if isinstance(item, str):
            return PendingAnswer(self, call, item, None)
        flight = _Flight(self._run(item, call))
        self._start(flight)
        self._flights.append(flight)
        return PendingAnswer(self, call, item, flight)

    def wait(self, pending: Sequence[PendingAnswer]) -> None:
        """Return once one of ``pending`` is ready (at once if one is, or none is given)."""
        while pending and not any(answer.ready() for answer in pending):
            waiting = next(answer.flight for answer in pending if answer.flight is not None
                           and answer.flight.outcome is None)
            waiting.result.wait(_POLL_S)

    def close(self) -> None:
        """Stop the worker processes (the calls still out are dropped)."""
        self._flights = []
        self._pool.close()

    def _parse(self, call: ToolCall) -> tuple[ToolSpec, dict[str, Any]] | str:
        """The tool and arguments ``call`` names, or why it cannot run."""
        try:
            name, arguments = parse_call(call.text)
        except ValueError as error:
            return str(error)
        if name not in self.specs:
            return f"unknown tool {name!r}; the tools are {sorted(self.specs)}"
        return self.specs[name], arguments

    def _run(self, item: tuple[ToolSpec, dict[str, Any]], call: ToolCall) -> tuple:
        """The arguments of :func:`_tool_call` for a parsed call."""
        spec, arguments = item
        return spec.target, arguments, call.record, spec.kwargs, self.timeout_s

    def _answer(self, call: ToolCall, item: tuple[ToolSpec, dict[str, Any]] | str,
                outcome: tuple[str, Any] | None, seconds: float) -> ToolAnswer:
        """What the policy reads back for ``call``: the tool's text, or the error.

        Raises:
            ToolError: the call failed, with ``on_error="error"``.
        """
        at = ""
        if isinstance(item, str):
            why, seconds = item, 0.0
        else:
            status, value = outcome
            if status == "ok":
                return ToolAnswer(value, False, seconds)
            why, at = f"tool {item[0].name!r} {value}", getattr(value, "at", "")
        if self.on_error == "error":
            raise ToolError(f"{why} on prompt record #{call.index} "
                            f"({_excerpt(call.record)}); call: {call.text[-200:]!r}"
                            f"{f'; raised at {at}' if at else ''}; fix the tool, or set "
                            "rollout.tool_on_error=observe to show such errors to the policy and "
                            "count them in rollout/tool_errors")
        return ToolAnswer(f"error: {why}", True, seconds)

    def _start(self, flight: _Flight) -> None:
        """Submit ``flight`` to the pool; its deadline counts from now."""
        def on_back() -> None:
            flight.back = time.monotonic()

        flight.result = self._pool.submit_call(_tool_call, flight.run, on_back)
        flight.since = time.monotonic()

    def _poll(self) -> None:
        """Read back the calls that are back, and stop a lost one (:meth:`submit`)."""
        now = time.monotonic()
        for flight in self._flights:
            if flight.outcome is None and flight.result.ready():
                flight.outcome = self._pool.outcome(flight.result, now)
        while self._flights and self._flights[0].outcome is not None:
            back = self._flights.pop(0).back
            if self._flights:  # a worker was free for the next one from then on
                self._flights[0].since = max(self._flights[0].since, back)
        if not self._flights or now <= self._pool.due(self._flights[0].since):
            return
        lost, *rest = self._flights
        lost.outcome, lost.back = self._pool.outcome(lost.result, now), now
        self._pool.close()
        self._flights = [flight for flight in rest if flight.outcome is None]
        for flight in self._flights:
            self._start(flight)


_POLL_S = 0.005
"""How long :meth:`Tools.wait` waits on one call before it looks at the others again."""


@dataclass
class _Flight:
    """A submitted call in the pool."""

    run: tuple
    result: Any = None
    """The pool's ``AsyncResult``."""
    since: float = 0.0
    """From when the pool may run it (``time.monotonic()``): its deadline counts from here."""
    outcome: tuple[str, Any] | None = None
    back: float = 0.0
    """When its result came back to the pool (set in the pool's result thread)."""


class PendingAnswer:
    """The answer to a submitted call (:meth:`Tools.submit`)."""

    def __init__(self, tools: Tools, call: ToolCall,
                 item: tuple[ToolSpec, dict[str, Any]] | str, flight: _Flight | None) -> None:
        self.tools, self.call, self.item, self.flight = tools, call, item, flight
        self.submitted = time.monotonic()

    def ready(self) -> bool:
        """Whether :meth:`answer` returns without waiting."""
        if self.flight is None:
            return True
        if self.flight.outcome is None:
            self.tools._poll()  # noqa: SLF001 - the pool's state is the tools'
        return self.flight.outcome is not None

    def answer(self, wait: bool = True) -> ToolAnswer:
        """The answer, as :meth:`Tools.call` gives it.

        Args:
            wait: wait for the call; False: it must be :meth:`ready`.

        Raises:
            RuntimeError: not ready and ``wait`` False.
            ToolError: the call failed, with ``on_error="error"``.
        """
        if wait:
            self.tools.wait([self])
        elif not self.ready():
            raise RuntimeError("the tool call is not back yet; wait for it or check ready()")
        if self.flight is None:
            return self.tools._answer(self.call, self.item, None, 0.0)  # noqa: SLF001
        return self.tools._answer(self.call, self.item, self.flight.outcome,  # noqa: SLF001
                                  self.flight.back - self.submitted)
