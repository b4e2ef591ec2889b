"""Every torch.distributed collective in the package names its process group.

A collective without ``group=`` runs on the world group, which deadlocks when the models on
disjoint ranks call different collectives. Where the world is meant, the call says
``group=dist.group.WORLD`` with a comment saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rlhf"

COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "P2POp",
}


def _calls_without_group(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules = {"torch.distributed"}
    if any(isinstance(node, ast.Import) and any(
            (a.name, a.asname) == ("torch.distributed", "dist") for a in node.names)
           for node in ast.walk(tree)):
        modules.add("dist")  # elsewhere ``dist`` may be, say, a probability distribution
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES or ast.unparse(node.func.value) not in modules:
            continue
        positional_group = node.func.attr == "P2POp" and len(node.args) >= 4
        if not positional_group and not any(k.arg == "group" for k in node.keywords):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                         f"{ast.unparse(node)[:80]}")
    return found


def test_every_collective_names_its_group() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    missing = [call for path in files for call in _calls_without_group(path)]
    assert not missing, "collectives without group=:\n" + "\n".join(missing)
