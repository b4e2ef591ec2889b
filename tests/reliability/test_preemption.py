"""Preemption under torchrun: SIGTERM to one worker makes every rank finish its current step,
save a checkpoint and exit 0 (the ranks agree on the stop at the step boundary)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.multirank
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_sigterm_to_one_rank_finishes_the_step_saves_and_exits_zero(tmp_path: Path) -> None:
    run_dir, save_dir = tmp_path / "run", tmp_path / "ckpt"
    log = (tmp_path / "log.txt").open("w")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", str(REPO / "tools" / "run_ppo.py"), "--steps", "500",
               "--run-dir", str(run_dir), "--save-dir", str(save_dir),
               "rollout.prompts_per_step=8", "rollout.ppo_epochs=1", "rollout.num_minibatches=1",
               "generation.max_new_tokens=6", "runtime.distributed.timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 240,
                  "the first step")
        workers = {_rank_of(pid): pid for pid in _children(job.pid)}
        os.kill(workers[3], signal.SIGTERM)
        returncode = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    output = (tmp_path / "log.txt").read_text()
    assert returncode == 0, output[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) < 500
    saved = sorted(p.name for p in save_dir.iterdir())
    assert saved == [f"step_{len(steps):08d}"], saved
    assert (save_dir / saved[0] / "manifest.json").is_file()
    assert "stopping after step" in output
