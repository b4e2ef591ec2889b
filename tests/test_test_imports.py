"""No test module imports another test module.

Importing ``tests/x/test_y.py`` from another test runs its module body a second time under
another name and ties two tests' private helpers together, so that a change for one breaks the
other. What tests share lives in ``tests/helpers/`` (or a non-``test_`` module beside them).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_no_test_module_imports_another_test_module() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 80
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}: {module}"
                 for path in files for line, module in _imported_modules(ast.parse(path.read_text()))
                 if module.startswith("tests.") and module.split(".")[-1].startswith("test_")]
    assert not offenders, "import from tests/helpers/ instead:\n" + "\n".join(offenders)
