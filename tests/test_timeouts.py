"""Every test's rank harness gives up before pytest does.

A multi-rank test hands its ranks a budget (``run_on_ranks(timeout_s=...)``, a subprocess's
``timeout=``). When that budget is not inside the test's own limit (``pytest.mark.timeout``, else
pyproject's ``timeout``), pytest-timeout kills the test first and the ranks' tracebacks, which
the harness would have printed, are lost. This reads every test's source (``ast``, nothing runs):
the budgets of the harness calls a test makes, directly or through a helper function (of its
module, ``tests/multirank.py`` or ``tests/helpers/``), summed, plus a margin for starting and
joining the ranks, must fit in the test's timeout.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DEFAULT_TIMEOUT_S = int(re.search(r"^timeout = (\d+)$", (REPO / "pyproject.toml").read_text(),
                                  re.M).group(1))
"""pyproject's ``timeout`` (tomllib is not in Python 3.10, the oldest one supported)."""
MARGIN_S = 30
"""Start of the fork server or interpreter, the join of the ranks and the report after a budget
runs out."""
HARNESS = {"run_on_ranks": ("timeout_s", 3, 180.0)}
"""Harness functions: the budget's keyword, its position, and its default."""
SUBPROCESS = {"run", "check_output", "check_call", "call", "wait", "communicate"}
"""``subprocess`` functions and ``Popen`` methods whose ``timeout=`` is a budget."""

Functions = dict[str, ast.FunctionDef]


def _functions(tree: ast.Module) -> Functions:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _constants(tree: ast.Module) -> dict[str, float]:
    values = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, int | float)):
            values[node.targets[0].id] = float(node.value.value)
    return values


def _shared_functions() -> Functions:
    """Module-level functions of the shared helpers, which any test may call by name."""
    shared: Functions = {}
    for path in [TESTS / "multirank.py", *sorted((TESTS / "helpers").glob("*.py"))]:
        shared.update(_functions(ast.parse(path.read_text())))
    return shared


def _value(node: ast.expr | None, names: dict[str, float]) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    return None


def _parameters(function: ast.FunctionDef, call: ast.Call,
                names: dict[str, float]) -> dict[str, float]:
    """The numeric parameters of ``function`` for ``call``: passed, else their defaults."""
    args = function.args
    params = [*args.posonlyargs, *args.args]
    bound: dict[str, float] = {}
    for param, default in zip(params[len(params) - len(args.defaults):], args.defaults,
                              strict=True):
        bound[param.arg] = _value(default, names)
    for param, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        bound[param.arg] = _value(default, names)
    for param, arg in zip(params, call.args, strict=False):
        bound[param.arg] = _value(arg, names)
    for keyword in call.keywords:
        if keyword.arg is not None:
            bound[keyword.arg] = _value(keyword.value, names)
    return {**names, **{k: v for k, v in bound.items() if v is not None}}


def _budget(body: ast.AST, functions: Functions, names: dict[str, float],
            problems: list[str], where: str, depth: int = 0) -> float:
    """Seconds of harness budget that running ``body`` may spend, summed over its calls."""
    total = 0.0
    for node in ast.walk(body):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) else None)
        keywords = {k.arg: k.value for k in node.keywords}
        if name in HARNESS:
            keyword, position, default = HARNESS[name]
            given = keywords.get(keyword) or (
                node.args[position] if len(node.args) > position else None)
            seconds = default if given is None else _value(given, names)
        elif name in SUBPROCESS and isinstance(func, ast.Attribute) and "timeout" in keywords:
            seconds = _value(keywords["timeout"], names)
        elif name in functions and depth < 3 and functions[name] is not body:
            callee = functions[name]
            total += _budget(callee, functions, _parameters(callee, node, names), problems,
                             where, depth + 1)
            continue
        else:
            continue
        if seconds is None:
            problems.append(f"{where}: cannot read the budget of {ast.unparse(node)[:80]}")
            continue
        total += seconds
    return total


def _timeout_of(function: ast.FunctionDef, module_timeout: float) -> float:
    for decorator in function.decorator_list:
        if (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.timeout"
                and decorator.args and isinstance(decorator.args[0], ast.Constant)):
            return float(decorator.args[0].value)
    return module_timeout


def _module_timeout(tree: ast.Module) -> float:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "pytestmark"):
            for mark in ast.walk(node.value):
                if isinstance(mark, ast.Call) and ast.unparse(mark.func) == "pytest.mark.timeout":
                    return float(mark.args[0].value)
    return float(DEFAULT_TIMEOUT_S)


def harness_budgets() -> tuple[dict[str, tuple[float, float]], list[str]]:
    """``{test: (harness budget, timeout)}`` of every test with a harness call, and the
    problems met reading them."""
    shared = _shared_functions()
    found, problems = {}, []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        functions = {**shared, **_functions(tree)}
        names = _constants(tree)
        module_timeout = _module_timeout(tree)
        for name, function in _functions(tree).items():
            if not name.startswith("test_"):
                continue
            where = f"{path.relative_to(REPO)}::{name}"
            budget = _budget(function, functions, names, problems, where)
            if budget:
                found[where] = (budget, _timeout_of(function, module_timeout))
    return found, problems


def test_every_harness_budget_fits_in_its_test_timeout() -> None:
    found, problems = harness_budgets()
    assert not problems, "\n".join(problems)
    assert len(found) > 40, "the reader finds the multi-rank tests"
    late = [f"{where}: harness {budget:.0f} s + {MARGIN_S} s margin > timeout {timeout:.0f} s; "
            f"add @pytest.mark.timeout({int(budget) + 2 * MARGIN_S})"
            for where, (budget, timeout) in found.items() if budget + MARGIN_S > timeout]
    assert not late, "pytest would kill these before their ranks report:\n" + "\n".join(late)


def test_the_reader_follows_helpers_and_defaults() -> None:
    source = '''
import pytest
LIMIT = 50
def _launch(*args, timeout=400):
    return subprocess.run(args, timeout=timeout)
def test_a():
    run_on_ranks(f, world_size=2, timeout_s=LIMIT)
    _launch("x")
    _launch("y", timeout=20)
@pytest.mark.timeout(900)
def test_b():
    run_on_ranks(f, 2)
'''
    tree = ast.parse(source)
    functions, names, problems = _functions(tree), _constants(tree), []
    assert _budget(functions["test_a"], functions, names, problems, "a") == 470
    assert _budget(functions["test_b"], functions, names, problems, "b") == 180
    assert _timeout_of(functions["test_b"], 300) == 900 and not problems
