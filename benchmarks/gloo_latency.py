"""Small-message gloo latencies on this CPU host: the figures the planner's CPU model rests on.

    python benchmarks/gloo_latency.py            # one JSON line, ~30 s on 2 cores

Measures, with one thread per process as the CPU benchmarks run:

- ``allreduce_pairs``: a 256-byte all-reduce between 2 processes alone on the host, 500 calls, in
  three freshly spawned pairs: median, mean and 90th percentile of a call (the calibration's
  latency is the median over pairs of the mean).
- ``allreduce_world4``: in a world of 4 processes, the same all-reduce over all 4 and over a
  2-rank subgroup while the other 2 wait in a barrier (mean of a call).
- ``exchange_world4``: every rank of 4 exchanges 1 or 9 small tensors ("fields") with each of the
  3 others in one batched isend/irecv (mean of a call), as the engine's row transfers do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megatron_rlhf.runtime.distributed import free_port  # noqa: E402

CALLS = 500
ELEMENTS = 64  # 256 bytes of float32


def _call_times(fn, calls: int) -> list[float]:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(times) * 1e3, 3),
            "mean_ms": round(statistics.mean(times) * 1e3, 3),
            "p90_ms": round(ordered[int(0.9 * len(ordered))] * 1e3, 3)}


def _exchange(tensor: torch.Tensor, fields: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = []
    for peer in range(world):
        if peer != rank:
            for _ in range(fields):
                ops.append(dist.P2POp(dist.isend, tensor, peer))
                ops.append(dist.P2POp(dist.irecv, torch.empty_like(tensor), peer))
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tensor = torch.ones(ELEMENTS)
        out = {}
        if world == 2:
            out["allreduce"] = _summary(_call_times(lambda: dist.all_reduce(tensor), CALLS))
        else:
            pair = dist.new_group([0, 1])
            times = _call_times(lambda: dist.all_reduce(tensor), CALLS)
            out["allreduce_all4_mean_ms"] = _summary(times)["mean_ms"]
            if rank < 2:
                times = _call_times(lambda: dist.all_reduce(tensor, group=pair), CALLS)
                out["allreduce_pair_others_waiting_mean_ms"] = _summary(times)["mean_ms"]
            dist.barrier()
            for fields in (1, 9):
                times = _call_times(lambda f=fields: _exchange(tensor, f), CALLS // 5)
                out[f"exchange_{fields}_fields_mean_ms"] = _summary(times)["mean_ms"]
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def _spawn(world: int) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(_worker, args=(world, free_port(), results), nprocs=world, join=True,
                       start_method="spawn")
    return results.get(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="2-process pairs to spawn")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: give 1 or more")
    pairs = [_spawn(2)["allreduce"] for _ in range(args.pairs)]
    world4 = _spawn(4)
    print(json.dumps({"benchmark": "gloo_latency", "cores": os.cpu_count(),
                      "allreduce_pairs": pairs,
                      "allreduce_world4": {k: v for k, v in world4.items()
                                           if k.startswith("allreduce")},
                      "exchange_world4": {k: v for k, v in world4.items()
                                          if k.startswith("exchange")}}))


if __name__ == "__main__":
    main()
