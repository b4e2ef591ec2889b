"""Tools the policy calls during a rollout, run in the reward functions' worker pool.

    tools = Tools(parse_tools([{"name": "my_tools:calculator"}]), on_error="observe",
                  timeout_s=10.0, workers=2)
    answers = tools.call([ToolCall(text, record, index), ...])   # one answer per call
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
from megatron_rlhf.rewards.pool import RewardFunctions, _excerpt, timed_call

TOOL_ON_ERROR = ("observe", "error")
"""``rollout.tool_on_error``: the error becomes the policy's observation, or the run stops."""

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The tags around a tool call in the policy's text."""

_imported: dict[str, Callable[..., Any]] = {}
"""The worker's imported tools, by target."""


class ToolError(RuntimeError):
    """A tool call failed with ``rollout.tool_on_error=error``."""

    local_cause = True


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
        self._pool = RewardFunctions([], "error", timeout_s, workers)

    def call(self, calls: Sequence[ToolCall]) -> list[ToolAnswer]:
        """Answer every call (the tools run concurrently in the pool), in order.

        Raises:
            ToolError: the first failed call, with ``on_error="error"``.
        """
        parsed: list[tuple[ToolSpec, dict[str, Any]] | str] = []
        for call in calls:
            try:
                name, arguments = parse_call(call.text)
            except ValueError as error:
                parsed.append(str(error))
                continue
            if name not in self.specs:
                parsed.append(f"unknown tool {name!r}; the tools are {sorted(self.specs)}")
                continue
            parsed.append((self.specs[name], arguments))
        runs = [(spec.target, arguments, call.record, spec.kwargs, self.timeout_s)
                for item, call in zip(parsed, calls, strict=True) if not isinstance(item, str)
                for spec, arguments in [item]]
        start = time.perf_counter()
        outcomes = iter(self._pool.run_calls(_tool_call, runs) if runs else [])
        seconds = (time.perf_counter() - start) / max(len(runs), 1)
        answers = []
        for item, call in zip(parsed, calls, strict=True):
            if isinstance(item, str):
                why = item
            else:
                status, value = next(outcomes)
                if status == "ok":
                    answers.append(ToolAnswer(value, False, seconds))
                    continue
                why = f"tool {item[0].name!r} {value}"
            if self.on_error == "error":
                raise ToolError(f"{why} on prompt record #{call.index} "
                                f"({_excerpt(call.record)}); call: {call.text[-200:]!r}; fix "
                                "the tool, or set rollout.tool_on_error=observe to show such "
                                "errors to the policy and count them in rollout/tool_errors")
            answers.append(ToolAnswer(f"error: {why}", True,
                                      0.0 if isinstance(item, str) else seconds))
        return answers

    def close(self) -> None:
        """Stop the worker processes."""
        self._pool.close()
