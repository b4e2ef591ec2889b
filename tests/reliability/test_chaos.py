"""Recovery without a person: under torchrun --max-restarts with --resume auto, a job whose
workers are SIGKILLed at random moments (whatever stage they are in: generation, transfers,
weight sync, training, a checkpoint save) restarts from its last complete checkpoint each time
and ends with the metrics and weights of an uninterrupted run, bit for bit; every checkpoint
left behind verifies."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rlhf.runtime.checkpoint_store import (
    complete_checkpoints,
    read_manifest,
    verify_checkpoint,
)
from tests.helpers.metrics import run_metrics
from tests.helpers.processes import children

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _job(tmp_path: Path, name: str, kills_after_steps: tuple[int, ...]) -> tuple[int, str]:
    run_dir, save_dir = tmp_path / name / "run", tmp_path / name / "ckpt"
    log_path = tmp_path / f"{name}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", str(len(kills_after_steps)),
               str(REPO / "tools" / "run_ppo.py"), "--steps", str(STEPS),
               "--placement", "separation", "--run-dir", str(run_dir), "--save-dir",
               str(save_dir), "--save-interval", "1", "--resume", "auto",
               "checkpoint.keep_last=0", "models.dropout=0.1", "rollout.prompts_per_step=8",
               "rollout.ppo_epochs=1", "rollout.num_minibatches=2",
               "generation.max_new_tokens=6", "runtime.distributed.timeout_s=60"]
    chaos = random.Random(1234)
    with log_path.open("w") as log:
        job = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            for restarts, after in enumerate(kills_after_steps):
                # Until the previous restart has resumed, metrics.jsonl still holds the killed
                # attempt's records: a kill then would land in start-up, before any resume.
                deadline = time.monotonic() + 240
                done, record_times = _steps_done(run_dir), []
                while ((done < after or log_path.read_text().count("resumed from") < restarts)
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
                    now_done = _steps_done(run_dir)
                    if now_done > done:
                        record_times.append(time.monotonic())
                    done = now_done
                # somewhere inside the next step or save, however fast this machine steps
                step_s = (record_times[-1] - record_times[-2]) if len(record_times) > 1 else 1.0
                time.sleep(chaos.uniform(0.0, step_s))
                workers = children(job.pid)
                assert workers, "no workers to kill"
                os.kill(chaos.choice(workers), signal.SIGKILL)
                time.sleep(1.0)
            code = job.wait(timeout=400)
        finally:
            if job.poll() is None:
                job.kill()
    return code, log_path.read_text()


def _model_files(checkpoint: Path) -> dict:
    """The sha256 of the files that hold the trained models' weights and optimizer state (not
    the dist checkpoint's ``.metadata``, which differs between writes of the same tensors)."""
    files = read_manifest(checkpoint)["files"]
    found = {name: entry["sha256"] for name, entry in files.items()
             if name.startswith(("actor/", "critic/")) and name.endswith(".distcp")}
    assert found, f"{checkpoint} holds no tensor files"
    return found


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_a_job_killed_at_random_recovers_to_the_uninterrupted_result(tmp_path: Path) -> None:
    code, log = _job(tmp_path, "calm", kills_after_steps=())
    assert code == 0, log[-3000:]
    # After 2 and 4 records: a checkpoint written in the background is complete only after the
    # next step, so a kill after the first record would find none and start afresh.
    code, log = _job(tmp_path, "chaos", kills_after_steps=(2, 4))
    assert code == 0, log[-3000:]
    assert log.count("resumed from") >= 2, "the job did not restart from its checkpoints twice"
    calm, chaos = tmp_path / "calm", tmp_path / "chaos"
    assert run_metrics(chaos / "run") == run_metrics(calm / "run")
    saved = complete_checkpoints(chaos / "ckpt")
    assert [p.name for p in saved] == [f"step_{k:08d}" for k in range(1, STEPS + 1)]
    assert all(verify_checkpoint(p) == [] for p in saved)
    final = f"step_{STEPS:08d}"
    assert _model_files(chaos / "ckpt" / final) == _model_files(calm / "ckpt" / final)
