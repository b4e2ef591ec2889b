"""Load a script of the repository (``tools/``, ``benchmarks/``) as a module to test its parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """Import ``REPO / relative_path`` under a name of its own (scripts are not a package)."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would be: dataclasses resolve the string
    # annotations of ``from __future__ import annotations`` through ``sys.modules``.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module
