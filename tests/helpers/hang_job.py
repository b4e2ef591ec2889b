"""A torchrun worker whose first attempt ends as a hung NCCL job ends: rank 1 hangs in a stage,
rank 0 finishes that stage's work, waits for it in a collective of a later stage and is aborted by a stand-in for NCCL's
watchdog (``os.abort`` after ``WATCHDOG_S``; the real one calls ``std::abort`` when a collective
times out, so no rank raises or reports). The restarted attempt does one barrier and ends.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 tests/helpers/hang_job.py
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from megatron_rlhf.runtime.distributed import DistributedConfig, init_distributed
from megatron_rlhf.runtime.faults import FaultConfig, install_fault_tracker

WATCHDOG_S = 3.0
WORK_S = 0.5  # rank 0's generation, before it goes on to training
TIMEOUT_S = 60.0  # gloo would raise only after this; the stand-in watchdog aborts first


def main() -> None:
    init_distributed(DistributedConfig(backend="gloo", timeout_s=TIMEOUT_S))
    tracker = install_fault_tracker(FaultConfig(), TIMEOUT_S)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0:
        with tracker.stage("step 0"):
            dist.barrier()
            with tracker.stage("step 0/generate"):
                time.sleep(10 * TIMEOUT_S if dist.get_rank() == 1 else WORK_S)
            with tracker.stage("step 0/train"):
                threading.Timer(WATCHDOG_S, os.abort).start()
                dist.all_reduce(torch.zeros(1))
    dist.barrier()
    print(f"rank {dist.get_rank()}: attempt {attempt} done", flush=True)


if __name__ == "__main__":
    main()
