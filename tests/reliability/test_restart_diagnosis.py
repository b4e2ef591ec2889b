"""The NCCL case, as far as CPU can show it: a rank hangs, the rank waiting for it in a collective
is aborted by a stand-in for NCCL's watchdog (nothing raises, nothing is reported), torchrun
restarts the job, and the restarted rank 0 reads the stage records the dead attempt left and
names the hung rank and its stage."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, tool_env


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_a_restart_names_the_rank_that_hung_in_the_aborted_attempt() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
               str(REPO / "tests" / "helpers" / "hang_job.py")]
    job = subprocess.run(command, cwd=REPO, env=tool_env(), capture_output=True, text=True,
                         timeout=120)
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-3000:]
    assert "attempt 1 done" in log, log[-3000:]
    assert "torchrun restarted the job (attempt 1); attempt 0 ended" in log, log[-3000:]
    assert "rank 1: stage 'step 0/generate'" in log, log[-3000:]
    assert "rank 0: stage 'step 0/train'" in log, log[-3000:]
    assert ("Likely cause: rank 1 in 'step 0/generate', while the other ranks had gone on to "
            "'step 0/train'") in log, log[-3000:]
