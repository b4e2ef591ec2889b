"""The package layering of megatron_rlhf: a package imports only packages below it.

Read from the source with ``ast`` (nothing is imported), so a new import that runs against the
order fails here with the module and the import that does it. ``testing`` (emulations and
hooks for the tests) sits on top; a production module may still load it, but only lazily: inside
a function, in the body of an ``if`` that reads one of the test switches (:data:`SWITCHES`).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rlhf"

LAYERS: list[set[str]] = [
    {"runtime"},
    {"topology"},
    {"models"},
    {"data", "generation", "algorithms", "refit", "planner", "rewards"},
    {"config"},
    {"builder"},
    {"engine", "supervised"},
    {"instructgpt", "testing"},
]
"""Lowest first; packages in one layer do not import each other."""

TESTING = "megatron_rlhf.testing"

SWITCHES = {"nccl_semantics_requested", "emulating_graphs"}
"""The functions that read a test switch from the environment
(``runtime.distributed``, ``generation.decode_step``)."""

ENGINE_ROOMS = ["execution", "step", "run"]
"""engine/'s rooms, lowest first: a room imports only the rooms before it."""


def _level(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def _imported_below(path: Path, package: str) -> set[str]:
    """The names right below ``package`` (dotted) that ``path`` imports: for ``megatron_rlhf``,
    ``from megatron_rlhf.models.gpt import x`` gives ``models``."""
    found = set()
    depth = package.count(".") + 1
    tree = ast.parse(path.read_text())
    switched = _switched_imports(tree)
    for node in ast.walk(tree):
        if id(node) in switched:
            continue
        found |= {name.split(".")[depth] for name in _names(node)
                  if name.startswith(f"{package}.")}
    return found


def _names(node: ast.AST) -> list[str]:
    """The modules an import statement names ([] for any other node)."""
    return ([node.module] if isinstance(node, ast.ImportFrom) and node.module
            else [a.name for a in node.names] if isinstance(node, ast.Import) else [])


def _switched_imports(tree: ast.AST) -> set[int]:
    """The ids of the imports of ``megatron_rlhf.testing`` that sit inside a function, in the
    body of an ``if`` whose condition calls a test switch (:data:`SWITCHES`)."""
    found = set()

    def visit(node: ast.AST, in_function: bool, switched: bool) -> None:
        names = _names(node)
        if names and in_function and switched and all(
                name == TESTING or name.startswith(f"{TESTING}.") for name in names):
            found.add(id(node))
        if isinstance(node, ast.If) and any(
                isinstance(call, ast.Call) and _called(call) in SWITCHES
                for call in ast.walk(node.test)):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, switched)
            return
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inside, switched)

    visit(tree, False, False)
    return found


def _called(call: ast.Call) -> str | None:
    """The name of the function ``call`` calls (``f`` for ``f()`` and ``m.f()``)."""
    return (call.func.id if isinstance(call.func, ast.Name)
            else call.func.attr if isinstance(call.func, ast.Attribute) else None)


def _imported_packages(path: Path) -> set[str]:
    return _imported_below(path, "megatron_rlhf")


def _package_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def test_every_package_is_in_a_layer() -> None:
    packages = {_package_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert packages == set().union(*LAYERS)


def _violations(paths: Iterable[Path], package: str, unit_of: Callable[[Path], str],
                level: Callable[[str], int]) -> list[str]:
    """Imports from ``paths`` of units right below ``package`` at the importer's level or
    above it (a unit may import itself)."""
    found = []
    for path in sorted(paths):
        source = unit_of(path)
        for target in _imported_below(path, package) - {source}:
            if level(target) >= level(source):
                shown = (path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent)
                         else path)
                found.append(f"{shown} imports {package}.{target}")
    return found


def test_no_import_runs_against_the_layers() -> None:
    modules = [p for p in PACKAGE.rglob("*.py") if _package_of(p) != "__init__"]
    assert _violations(modules, "megatron_rlhf", _package_of, _level) == []


def test_the_layer_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "module.py"
    bad.write_text("from megatron_rlhf.engine.step.ppo import PPOAlgorithm\nimport torch\n"
                   "import megatron_rlhf.models.gpt\n")
    assert _imported_packages(bad) == {"engine", "models"}
    # the supervised trainer may use models but not the PPO engine beside it
    assert _level("models") < _level("supervised") <= _level("engine")


def test_testing_is_imported_only_behind_a_test_switch(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "import os\n"
        "def install():\n"
        "    if nccl_semantics_requested() and os.environ:\n"
        "        from megatron_rlhf.testing import nccl_semantics\n"
        "    elif emulating_graphs():\n"
        "        import megatron_rlhf.testing.graph_standin\n"
        "    else:\n"
        "        from megatron_rlhf.testing.forcing import forcing_moves\n"
        "def build():\n"
        "    from megatron_rlhf.testing import graph_standin\n"
        "if emulating_graphs():\n"
        "    from megatron_rlhf.testing import graph_standin\n")
    tree = ast.parse(module.read_text())
    assert len(_switched_imports(tree)) == 2  # not the else branch, unguarded or module level
    assert _violations([module], "megatron_rlhf", lambda path: "generation", _level) == [
        f"{module} imports megatron_rlhf.testing"]
    assert _level("testing") > _level("engine")


def test_every_engine_module_is_in_a_room() -> None:
    engine = PACKAGE / "engine"
    loose = [p.name for p in engine.glob("*.py") if p.name != "__init__.py"]
    assert loose == [], "engine/ modules belong in one of its rooms"
    rooms = {p.name for p in engine.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(ENGINE_ROOMS)
    for room in ENGINE_ROOMS:
        assert (engine / room / "README.md").is_file(), f"engine/{room}/ has no README.md"


def test_no_engine_room_imports_a_later_room() -> None:
    engine = PACKAGE / "engine"
    modules = [p for room in ENGINE_ROOMS for p in (engine / room).rglob("*.py")]
    assert _violations(modules, "megatron_rlhf.engine",
                       lambda path: path.relative_to(engine).parts[0], ENGINE_ROOMS.index) == []


def test_the_room_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "module.py"
    bad.write_text("from megatron_rlhf.engine.run.build import build_engine\n"
                   "import megatron_rlhf.engine.execution.batch\nimport megatron_rlhf.engine\n")
    assert _imported_below(bad, "megatron_rlhf.engine") == {"run", "execution"}
    assert _violations([bad], "megatron_rlhf.engine", lambda path: "step",
                       ENGINE_ROOMS.index) == [f"{bad} imports megatron_rlhf.engine.run"]
