"""One ``reward.functions`` entry: which function, its weight, its keyword arguments; and the
registry of the reward functions an entry may name without their module.

An entry is a mapping ``{name: "package.module:function", weight: 1.0, **kwargs}``, or with a
registered name (``REWARD_FUNCTIONS``, e.g. ``math_reward``) as ``name``; the function is called
as ``function(prompt, response, record, **kwargs)`` (see ``pool.py``). Everything that can be
checked without calling it is checked here, when the run's config is built, before any process
group exists: the name is registered or the module imports, the attribute is callable, the weight
is a finite number, and no two functions share the metric name ``reward/<function>``.

A function is registered where it is defined (``verifiers.py`` registers the built-in ones)::

    @register_reward_function("my_reward")
    def my_reward(prompt: str, response: str, record: dict, **kwargs) -> float: ...
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ON_ERROR_POLICIES = ("error", "zero")
"""``reward.on_error``: raise naming the function and the record, or score the call 0 and count
it in ``reward/errors``."""

RESERVED_KEYS = ("name", "weight")
"""Keys of an entry that are not keyword arguments of the function."""

RewardFunction = Callable[..., Any]
"""``(prompt, response, record, **kwargs) -> float`` (or a dict with a ``score``)."""

REWARD_FUNCTIONS: dict[str, RewardFunction] = {}
"""Name -> function, filled by ``register_reward_function`` where each is defined."""


def register_reward_function(name: str) -> Callable[[RewardFunction], RewardFunction]:
    """Decorator that lets a ``reward.functions`` entry name a module-level function ``name``.

    Raises:
        ValueError: ``name`` is already registered, or holds a ``:``.
    """

    def register(function: RewardFunction) -> RewardFunction:
        if ":" in name or name in REWARD_FUNCTIONS:
            raise ValueError(f"reward function {name!r} is already registered or holds a ':' "
                             "(which names 'package.module:function'); pick another name")
        REWARD_FUNCTIONS[name] = function
        return function

    return register


def registered_target(name: str, where: str = "reward.functions") -> str:
    """``package.module:function`` of the function registered as ``name``: the workers import
    it by that path, as they do an entry that names the path itself.

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names), or its
            function cannot be imported by its path.
    """
    if name not in REWARD_FUNCTIONS:
        raise ValueError(f"{where}.name={name!r} is no registered reward function "
                         f"({sorted(REWARD_FUNCTIONS)}); name one of those or your own as "
                         "'package.module:function'")
    function = REWARD_FUNCTIONS[name]
    target = f"{function.__module__}:{function.__qualname__}"
    if "<" in target or import_function(target, where) is not function:
        raise ValueError(f"{where}.name={name!r}: the registered {target} is not importable by "
                         "that path, which the reward workers need; register a module-level "
                         "function")
    return target


@dataclass(frozen=True)
class RewardFunctionSpec:
    """A checked ``reward.functions`` entry.

    Attributes:
        target: ``package.module:function``.
        weight: the weight of its score in the sequence score (beside ``reward.model_weight``
            and ``reward.rule_weight``).
        kwargs: keyword arguments of every call (the entry's other keys).
    """

    target: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def metric(self) -> str:
        """``reward/<function>``: the batch mean of its (unweighted) score."""
        return f"reward/{self.target.rpartition(':')[2]}"


def import_function(target: str, where: str = "reward.functions") -> Callable[..., Any]:
    """The callable named by ``package.module:function``.

    Raises:
        ValueError: a malformed name, a module that does not import, or an attribute that is
            missing or not callable; the message names ``where`` and the fix.
    """
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{where}.name={target!r} must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure of the user's module is refused here
        raise ValueError(f"{where}.name={target!r}: module {module_name!r} does not import "
                         f"({type(error).__name__}: {error}); check the name and that it is on "
                         "PYTHONPATH") from error
    function: Any = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
    if not callable(function):
        raise ValueError(f"{where}.name={target!r}: {module_name!r} has no callable "
                         f"{attribute!r}")
    return function


def parse_reward_functions(entries: Sequence[Mapping[str, Any]]) -> list[RewardFunctionSpec]:
    """Check ``reward.functions`` and return one spec per entry.

    Raises:
        ValueError: an entry that is not a mapping or has no ``name``, a function that does not
            import or is not callable, a weight that is not a finite number, or two functions
            with the same metric name; each names ``reward.functions[i]``.
    """
    specs = []
    for index, entry in enumerate(entries):
        where = f"reward.functions[{index}]"
        if not isinstance(entry, Mapping) or "name" not in entry:
            raise ValueError(f"{where}={entry!r} must be a mapping with a 'name' "
                             "('package.module:function') and optionally 'weight' and the "
                             "function's keyword arguments")
        target, weight = entry["name"], entry.get("weight", 1.0)
        if not isinstance(target, str):
            raise ValueError(f"{where}.name={target!r} must be 'package.module:function' or a "
                             f"registered name ({sorted(REWARD_FUNCTIONS)})")
        if ":" not in target:
            target = registered_target(target, where)
        if (isinstance(weight, bool) or not isinstance(weight, int | float)
                or not math.isfinite(weight)):
            raise ValueError(f"{where}.weight={weight!r} must be a finite number")
        function = import_function(target, where)
        kwargs = {key: value for key, value in entry.items() if key not in RESERVED_KEYS}
        _check_arguments(function, kwargs, where, target)
        specs.append(RewardFunctionSpec(target, float(weight), kwargs))
    metrics = [spec.metric for spec in specs]
    for index, metric in enumerate(metrics):
        if metric in metrics[:index]:
            raise ValueError(f"reward.functions[{index}].name={specs[index].target!r}: another "
                             f"function is also logged as {metric!r}; give one of them another "
                             "function name (a wrapper in your module)")
    return specs


def _check_arguments(function: Callable[..., Any], kwargs: dict[str, Any], where: str,
                     target: str) -> None:
    """Refuse a function that cannot be called as ``function(prompt, response, record,
    **kwargs)`` (a wrong signature or a typo would otherwise fail at the first call), naming the
    function and what to change."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins without a signature: checked at the first call
        return
    try:
        signature.bind("prompt", "response", {}, **kwargs)
        return
    except TypeError as error:
        why = str(error)
    name = target.rpartition(":")[2].rpartition(".")[2]
    bare = signature.replace(  # annotations would only crowd the message
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty)
    shown = f"{where} = {target}{bare}"
    parameters = signature.parameters.values()
    try:
        signature.bind_partial("prompt", "response", {})
    except TypeError:
        extra = "".join(f", {key}=..." for key in sorted(kwargs))
        raise ValueError(
            f"{shown} cannot be called as {name}(prompt, response, record{extra}) ({why}): a "
            "reward function takes the prompt text, the response text and the prompt's record "
            f"(a dict) as its first three positional parameters; define it as "
            f"`def {name}(prompt, response, record{extra.replace('=...', '')}): ...` and read "
            "what you need from the record") from None
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        options = named[3:]
        unknown = sorted(key for key in kwargs if key not in options)
        if unknown:
            one = len(unknown) == 1
            it = "it" if one else "them"
            fix = (f"rename {it} to one of {options}, remove {it}" if options
                   else f"{target} takes none: remove {it}")
            what = "is not a keyword parameter" if one else "are not keyword parameters"
            raise ValueError(
                f"{shown}: {unknown} {what} of {target}; an entry's keys other than 'name' and 'weight' are passed to the "
                f"function as keyword arguments: {fix}, or add {it} to the function's parameters")
    missing = [p.name for p in parameters
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in kwargs][3:]
    if missing:
        raise ValueError(
            f"{shown}: {target} requires {missing}, which the entry does not give: add "
            + ", ".join(f"{key}: <value>" for key in missing)
            + f" to {where} (as keys beside 'name'), or give "
            f"{'it a default' if len(missing) == 1 else 'them defaults'} in the function")
    raise ValueError(f"{shown} cannot be called as {name}(prompt, response, record, "
                     f"**{sorted(kwargs)}): {why}")
