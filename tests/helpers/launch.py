"""Launching the repository's tools as a user would, under torchrun or plain Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tool_env(**extra: str) -> dict[str, str]:
    """The environment of a launched tool: this checkout first on the path, one thread per rank
    (the test machine has few cores and several ranks share them)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def tool_command(script: str, args: list[str], nproc: int = 0) -> list[str]:
    """``python tools/<script> args``, under ``torchrun --standalone`` with ``nproc`` ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    return [*launcher, str(REPO / "tools" / script), *args]


def run_tool(script: str, args: list[str], nproc: int = 0,
             timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``tools/<script>`` to completion (see :func:`tool_command`); output captured as text.

    Args:
        script: file name under ``tools/``.
        args: its command line.
        nproc: ranks under torchrun; 0 runs the script in one plain process.
        timeout: seconds before the process is killed (``subprocess.TimeoutExpired``).
    """
    return subprocess.run(tool_command(script, args, nproc), cwd=REPO, env=tool_env(),
                          capture_output=True, text=True, timeout=timeout)
