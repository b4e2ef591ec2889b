"""Importing megatron_rlhf changes nothing process-wide; the CPU patches are made and undone only
by explicit calls (``runtime.patches``).

Each check runs in a fresh interpreter: the test process itself has long been patched by other
tests' ``initialize_runtime``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Records every piece of process-wide state that the package has ever been tempted to change.
_SNAPSHOT = textwrap.dedent("""
    import logging, os, signal, sys, warnings
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher
    from torch.overrides import _get_current_function_mode_stack

    def snapshot():
        return {
            "torch.cuda": {name: id(getattr(torch.cuda, name)) for name in dir(torch.cuda)},
            "mode stack": (torch._C._len_torch_function_stack(),
                           len(_get_current_function_mode_stack())),
            "warnings.filters": list(warnings.filters),
            "all_gather_object": id(dist.all_gather_object),
            "root handlers": list(logging.root.handlers),
            "root level": logging.root.level,
            "package handlers": list(logging.getLogger("megatron_rlhf").handlers),
            "rng tracker": (id(mcore_random._CUDA_RNG_STATE_TRACKER),
                            mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
                            id(mcore_random._get_cuda_rng_state),
                            id(mcore_random._set_cuda_rng_state)),
            "memory buffer": parallel_state._GLOBAL_MEMORY_BUFFER,
            "moe split sizes": id(token_dispatcher.maybe_move_tensor_to_cpu),
            "sigterm": signal.getsignal(signal.SIGTERM),
            "environ": dict(os.environ),
            "default dtype": torch.get_default_dtype(),
            "process group": dist.is_initialized(),
        }

    def differences(before, after):
        return [key for key in before if before[key] != after[key]]
""")


def _run(body: str) -> str:
    script = _SNAPSHOT + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(360)
def test_importing_every_module_changes_nothing_global() -> None:
    out = _run("""
        import importlib, pkgutil
        before = snapshot()
        import megatron_rlhf
        names = [info.name for info in pkgutil.walk_packages(megatron_rlhf.__path__,
                                                             "megatron_rlhf.")]
        for name in names:
            importlib.import_module(name)
        assert len(names) > 50, names
        assert "megatron_rlhf.runtime.patches" in sys.modules
        changed = differences(before, snapshot())
        assert not changed, f"importing megatron_rlhf changed {changed}"
        print("imported", len(names))
    """)
    assert "imported" in out


@pytest.mark.timeout(360)
def test_cpu_patches_apply_and_undo() -> None:
    out = _run("""
        from megatron_rlhf.runtime import patches
        before = snapshot()
        assert patches.apply_cpu_compat() is True
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch._C._len_torch_function_stack() == 1
        during = snapshot()
        assert {"torch.cuda", "mode stack", "rng tracker",
                "moe split sizes"} <= set(differences(before, during))
        assert token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]),
                                                         as_numpy=True).tolist() == [3, 1]
        patches.undo_cpu_compat()
        changed = differences(before, snapshot())
        assert not changed, f"undo_cpu_compat left {changed} changed"
        assert not patches.cpu_compat_active()
        try:
            torch.zeros(1, device="cuda")
        except (RuntimeError, AssertionError):
            print("undone")
    """)
    assert "undone" in out


def test_every_patch_names_its_reason_and_caller() -> None:
    from megatron_rlhf.runtime import patches

    assert patches.CHECKED_WITH["megatron-core"] == "0.16.1"
    assert len({patch.target for patch in patches.PATCHES}) == len(patches.PATCHES)
    for patch in patches.PATCHES:
        assert patch.reason and patch.applied_by, patch
        function = patch.applied_by.split()[0]
        assert function == "called" or hasattr(patches, function), patch


@pytest.mark.timeout(360)
def test_moe_router_gemm_defined_only_where_transformer_engine_is_missing() -> None:
    out = _run("""
        from megatron.core.transformer.moe import moe_utils
        from megatron_rlhf.runtime import patches
        had_te = moe_utils.HAVE_TE
        before = getattr(moe_utils, "te_general_gemm", "missing")
        patches.define_moe_router_gemm()
        after = moe_utils.te_general_gemm
        assert (before == "missing") == (not had_te), (before, had_te)
        assert after is (None if not had_te else before)
        patches.define_moe_router_gemm()
        assert moe_utils.te_general_gemm is after
        print("router gemm", had_te)
    """)
    assert "router gemm" in out
