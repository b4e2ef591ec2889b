"""Whole runs of the entry points under torchrun, for the benchmarks that time them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLACEMENT_RUNS = {
    "flattening": ["placement.strategy=flattening"],
    "separation": ["placement.strategy=separation"],
    "separation-async": ["placement.strategy=separation", "rollout.async_rollout=true"],
}
"""The static placements the whole-run benchmarks compare, as overrides."""


def torchrun(script: str, ranks: int, *args: str) -> list[str]:
    """The command line of ``tools/<script>`` on ``ranks`` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), str(REPO / "tools" / script), *args]


def execute(argv: list[str], log: Path, pythonpath: tuple[Path, ...] = ()) -> float:
    """Run ``argv`` from the repository, one thread per rank, its output into ``log``; returns
    its wall seconds.

    Args:
        pythonpath: folders put first on ``PYTHONPATH`` (a run's user modules).

    Raises:
        RuntimeError: the command failed, naming its log.
    """
    path = os.pathsep.join(filter(None, [*map(str, pythonpath), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": path} if path else {})}
    begin = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - begin
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): see {log}")
    return seconds


def metrics_records(run_dir: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
