"""Measure this machine and write a hardware profile for the planner's cost model.

    python tools/calibrate.py --name cpu-local --out runs/profiles/cpu-local.json
    python tools/calibrate.py --name H100-measured --out h100.json      # on a GPU node
    python tools/plan_placement.py ... --predict --profile runs/profiles/cpu-local.json

Measures: dense matmul throughput (fp32 on CPU, bf16 on GPU), memory copy bandwidth, host copy
bandwidth (pinned host-to-device on GPU), the latency of one small transformer layer, of a model
call and of an optimizer step, and the
all-reduce bus bandwidth of a 2-process group spawned here (NCCL with 2+ GPUs, else gloo) at a
few sizes. Writes a ``HardwareProfile`` JSON and prints one JSON line. About 12 s on 2 CPU cores.

With ``--ranks N`` on a CPU, the profile describes ranks that share this machine's cores (as the
gloo tests and CPU benchmarks run them, one thread each): rates are measured on one thread (a
rank running alone) and ``host_cores`` records the cores, so the planner slows ranks down while
more of them are busy than there are cores. The layer, call and optimizer-step latencies are
measured on megatron's own layer, schedule, DDP and optimizer through this package's builder,
generator and trainer.

Measured peaks are what a collective, a copy or a large matmul achieves, so the profile's
efficiencies default to 1.0 for links and memory and to 0.5 for compute (a model step reaches
about half of a large matmul's rate); tune them with ``megatron_rlhf.planner.evaluate``.
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

from megatron_rlhf import __version__  # noqa: E402
from megatron_rlhf.planner.hardware import HardwareProfile  # noqa: E402
from megatron_rlhf.runtime.distributed import free_port  # noqa: E402

COLLECTIVE_BYTES = (2**8, 2**20, 2**24)
LATENCY_REPEATS = 500
"""Timed calls of the smallest all-reduce. Their mean is the latency: on a shared CPU a call
usually takes ~0.3 ms but one in ten waits a scheduler tick (~4 ms), and a run pays the mean
(``benchmarks/gloo_latency.py``)."""
COLLECTIVE_PAIRS = 3
"""Pairs of processes spawned one after another to time the all-reduces (the median is kept)."""


def _timed(fn, repeats: int, sync, statistic=statistics.median) -> float:
    """Median (or ``statistic``) seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - begin)
    return statistic(times)


def measure_matmul(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...],
                   sync) -> float:
    """Best dense ``n x n @ n x n`` throughput over ``sizes``, TFLOP/s."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        best = max(best, 2 * n**3 / _timed(lambda a=a, b=b: a @ b, 3, sync) / 1e12)
    return best


def measure_copy(device: torch.device, nbytes: int, sync) -> float:
    """Device memory bandwidth of a large copy (read + write), GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), 5, sync) / 1e9


def measure_host(device: torch.device, nbytes: int, sync) -> float:
    """Host-to-device bandwidth from pinned memory, GB/s (the copy bandwidth on CPU)."""
    if device.type != "cuda":
        return measure_copy(device, nbytes, sync) / 2
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _timed(lambda: dst.copy_(host, non_blocking=True), 5, sync) / 1e9


def measure_call_latencies(device: torch.device, dtype: torch.dtype,
                           sync) -> tuple[float, float, float]:
    """Fixed costs of the engine's calls, as it pays them: (per layer, per model call, per
    optimizer step).

    The layer latency is the forward time of a 6-layer minus a 2-layer tiny GPTModel, per layer;
    the call latency is what a decode step of the 2-layer model (our KV-cached generation: one
    model call and the sampling) costs beyond its 2 layers; the step latency is one training step
    of the 2-layer model (megatron schedule, DDP, the distributed optimizer) minus three forward
    passes (forward + a backward of about two). All run through this package's builder,
    generator and trainer in a world of one process.
    """
    from megatron_rlhf.generation import GenerationConfig, generate_sequences
    from megatron_rlhf.models.forward_backward import model_inputs
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.groups import build_model_process_groups
    from megatron_rlhf.topology.models import ArchSpec, ModelSpec

    initialize_runtime()
    options = ModelBuildOptions(params_dtype=str(dtype).removeprefix("torch."))
    forward, models = {}, {}
    for layers in (2, 6):
        arch = ArchSpec("calibration", layers, 64, 4, 256, 64, 256, gated_mlp=True)
        pgc = build_model_process_groups(ModelSpec("actor", arch, trainable=True))
        models[layers] = (build_gpt_model(arch, options, pgc).to(device), pgc)
        ids = torch.randint(0, arch.vocab_size, (2, 16), device=device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        inputs = model_inputs(batch)
        model = models[layers][0].eval()
        with torch.no_grad():
            forward[layers] = _timed(lambda model=model, inputs=inputs: model(*inputs), 10, sync)
    layer = max(1e-6, (forward[6] - forward[2]) / 4)
    model, pgc = models[2]
    new_tokens = 12
    generation = GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False)
    prompts = [list(range(5, 13))] * 4
    decode = _timed(lambda: generate_sequences(model, pgc, prompts, range(4), generation, None, 0),
                    5, sync) / new_tokens  # a model call per token, the first the prefill
    trainer = ModelTrainer(model.train(), pgc, OptimizerSettings(lr=1e-6))

    def loss_fn(output, micro):
        total = output.float().mean()
        return total, torch.ones((), dtype=torch.int, device=device), {}

    step = _timed(lambda: trainer.train_step([batch], loss_fn), 10, sync)
    return layer, max(0.0, decode - 2 * layer), max(0.0, step - 3 * forward[2])


def _collective_worker(rank: int, port: int, backend: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
        samples = []
        for nbytes in COLLECTIVE_BYTES:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            latency = nbytes == COLLECTIVE_BYTES[0]
            samples.append((nbytes, _timed(lambda t=tensor: dist.all_reduce(t),
                                           LATENCY_REPEATS if latency else 5, sync,
                                           statistics.mean if latency else statistics.median)))
        if rank == 0:
            results.put(samples)
    finally:
        dist.destroy_process_group()


def measure_collectives(backend: str) -> list[tuple[int, float]]:
    """(bytes, seconds) of a 2-rank all-reduce at each of ``COLLECTIVE_BYTES``: the median over
    ``COLLECTIVE_PAIRS`` freshly spawned pairs of processes (on a shared CPU one pair's mean
    latency can differ from the next one's by a third or more, depending on where the scheduler
    puts them: ``benchmarks/gloo_latency.py``)."""
    context = mp.get_context("spawn")
    runs = []
    for _ in range(COLLECTIVE_PAIRS):
        results = context.Queue()
        mp.start_processes(_collective_worker, args=(free_port(), backend, results), nprocs=2,
                           join=True, start_method="spawn")
        runs.append(results.get(timeout=10))
    return [(nbytes, statistics.median(run[i][1] for run in runs))
            for i, (nbytes, _) in enumerate(runs[0])]


def fit_links(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, bus bandwidth bytes/s) of a 2-rank all-reduce: the smallest message's time,
    and the best ``2 (n-1)/n * bytes / t`` (= bytes / t for n = 2) of the larger ones."""
    latency = min(samples)[1]
    bandwidth = max(nbytes / seconds for nbytes, seconds in samples[1:])
    return latency, bandwidth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--name", default="cpu-local", help="profile name (= the pool kind)")
    parser.add_argument("--out", type=Path, default=Path("calibrated-profile.json"))
    parser.add_argument("--compute-efficiency", type=float, default=0.5)
    parser.add_argument("--copy-mib", type=int, default=256, help="size of the copy test")
    parser.add_argument("--ranks", type=int, default=0,
                        help="CPU only: ranks that will share this machine, one thread each")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    shared_cores = 0.0
    if args.ranks and not cuda:
        torch.set_num_threads(1)
        shared_cores = float(os.cpu_count() or 1)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = (2048, 4096, 8192) if cuda else (256, 512, 1024)
    backend = "nccl" if cuda and torch.cuda.device_count() >= 2 else "gloo"
    latency, bus = fit_links(measure_collectives(backend))
    layer_latency, call_latency, step_latency = measure_call_latencies(device, dtype, sync)
    memory = (torch.cuda.get_device_properties(0).total_memory if cuda
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    profile = HardwareProfile(
        name=args.name, peak_tflops=measure_matmul(device, dtype, sizes, sync),
        hbm_gb_per_s=measure_copy(device, args.copy_mib * 2**20, sync),
        memory_gib=memory / 2**30, intra_node_gbps=bus * 8 / 1e9, inter_node_gbps=bus * 8 / 1e9,
        host_gb_per_s=measure_host(device, args.copy_mib * 2**20, sync),
        compute_efficiency=args.compute_efficiency, memory_efficiency=1.0, link_efficiency=1.0,
        layer_latency_s=layer_latency, call_latency_s=call_latency, step_latency_s=step_latency,
        collective_latency_s=latency, host_cores=shared_cores,
        source=f"tools/calibrate.py on {torch.cuda.get_device_name(0) if cuda else 'CPU'} "
               f"({os.cpu_count()} cores, {args.ranks or 1} ranks sharing it), {backend} "
               "all-reduce of 2 local processes; "
               "inter_node_gbps is the local figure: set it for a real network",
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print(json.dumps({"out": str(args.out), **profile.to_dict()}))


if __name__ == "__main__":
    main()
