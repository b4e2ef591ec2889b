"""Run a test function on N gloo ranks, each in its own process.

    results = run_on_ranks(check_fn, world_size=4, args=(cfg,), timeout_s=120)

``check_fn(*args)`` runs on every rank after the default process group exists (RANK, WORLD_SIZE
and friends are set as torchrun sets them) and may return a picklable value; the list of the
ranks' values comes back in rank order. Any rank that raises makes the call fail with every failing
rank's traceback; a rank that is still running at the deadline is killed with all others, and the
call fails naming the stuck ranks. No process outlives the call. A rank killed by a signal
(a segmentation fault in a native library) is reported with the Python stack of each of its
threads at the moment it died (:mod:`faulthandler`).

On a machine without CUDA the ranks fork from a server process that has imported torch and
megatron-core once (multiprocessing's ``forkserver``): a fresh interpreter per rank spent seconds
importing them for every test. With CUDA each rank is spawned. The server takes the environment
and working directory of the first call; each rank gets ``env`` and the rank variables
explicitly.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from megatron_rlhf.runtime.distributed import free_port


class MultiRankError(AssertionError):
    """One or more ranks failed or timed out."""


PRELOADED = ("torch", "megatron.core.models.gpt", "megatron_rlhf.engine.run.build")
"""Imported once by the fork server; most ranks need all of them."""


def _context() -> mp.context.BaseContext:
    """The fork-server context, with :data:`PRELOADED` (set before its server starts); spawn on
    a machine with CUDA, where importing Transformer Engine may create a CUDA context that
    forked ranks could not use."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
           env: dict[str, str], timeout_s: float, backend: str, results: mp.Queue,
           fault_path: str) -> None:
    fault_log = open(fault_path, "w")  # noqa: SIM115 - open until the process dies
    faulthandler.enable(file=fault_log, all_threads=True)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from megatron_rlhf.runtime.distributed import (
        DistributedConfig,
        destroy_distributed,
        init_distributed,
    )

    try:
        init_distributed(DistributedConfig(backend=backend, timeout_s=max(5.0, timeout_s * 0.8)))
        value = fn(*args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed()


def _fault_report(path: str) -> str:
    """What :mod:`faulthandler` wrote when the rank died of a signal, or nothing."""
    with open(path) as log:
        stacks = log.read().strip()
    return f"; its threads when it died:\n{stacks}" if stacks else ""


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (),
                 timeout_s: float = 180.0, env: dict[str, str] | None = None,
                 backend: str = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks (gloo by default) and return each rank's value.

    Args:
        fn: a module-level function (pickled by reference).
        world_size: number of ranks.
        args: picklable arguments passed to ``fn`` on every rank.
        timeout_s: hard wall-clock limit for the whole call.
        env: extra environment variables for the ranks.
        backend: ``gloo``, ``nccl`` (one GPU per rank) or ``auto``.

    Raises:
        MultiRankError: a rank raised, died without reporting, or was still running at the
            deadline. The message holds every failing rank's traceback.
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    fault_dir = tempfile.TemporaryDirectory(prefix="multirank-faults-")
    fault_paths = [os.path.join(fault_dir.name, f"rank{rank}.txt") for rank in range(world_size)]
    # Not daemonic: a rank may start worker processes of its own (reward functions' pool), which
    # a daemonic process may not; the ``finally`` below kills every rank either way.
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, port, args, env or {}, timeout_s,
                                         backend, results, fault_paths[rank]), daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                outcomes[rank] = (status, value)
            except queue.Empty:
                dead_silent = [r for r, p in enumerate(procs)
                               if r not in outcomes and p.exitcode is not None]
                if dead_silent:
                    time.sleep(1.0)  # a dying rank's last message may still be in the pipe
                    while not results.empty():
                        rank, status, value = results.get()
                        outcomes[rank] = (status, value)
                    dead_silent = [r for r in dead_silent if r not in outcomes]
                    for r in dead_silent:
                        outcomes[r] = ("error", f"process exited with code {procs[r].exitcode} "
                                                f"without reporting{_fault_report(fault_paths[r])}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcomes) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        fault_dir.cleanup()
    failures = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(outcomes.items()) if s != "ok"]
    stuck = [r for r in range(world_size) if r not in outcomes]
    if stuck:
        failures.append(f"ranks {stuck} still running after {timeout_s:.0f}s; killed")
    if failures:
        raise MultiRankError("\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]
