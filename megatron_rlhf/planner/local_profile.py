"""A hardware profile of this CPU, measured once and cached, for the pool a CPU run launches on.

    profiles = pool_profiles(cluster, profile=None)   # given, shipped or measured; for the planner

A CPU run's pool is ``local`` (``topology.cluster.cluster_from_environment``), which no shipped
profile describes. Without CUDA and on one node, its profile is measured here in well under a
second (a single-thread fp32 matmul's FLOP/s, a memory copy's bytes/s, the process's memory
limit or the machine's RAM) and cached as ``<cache>/<hostname-hash>.json``, so every rank of the
node and every later run reads the same numbers: the first rank to take the cache's file lock
measures, the others wait and read. ``tools/calibrate.py`` measures more (latencies, collectives)
and writes a profile to give as ``--profile`` instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rlhf.planner.hardware import HardwareProfile, load_profile, shipped_profiles
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.topology.cluster import ClusterSpec

LOCAL_POOL = "local"
"""The kind of the pool ``cluster_from_environment`` makes of torchrun's world."""
PROFILE_CACHE_DIR = "~/.cache/megatron_rlhf/profiles"
CPU_COLLECTIVE_LATENCY_S = 3e-4
"""A gloo call between local processes (about 0.3 ms, ``tools/calibrate.py``), not measured here."""
logger = get_logger(__name__)


@dataclass(frozen=True)
class CPUMeasurement:
    """What :func:`measure_cpu` finds.

    Attributes:
        flops_per_s: dense fp32 matmul on one thread (a CPU rank runs on one).
        copy_bytes_per_s: a large memory copy, bytes read plus written per second.
        memory_bytes: the process's memory limit (cgroup), else the machine's RAM.
        seconds: how long measuring took.
    """

    flops_per_s: float
    copy_bytes_per_s: float
    memory_bytes: float
    seconds: float


def _timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
    return best


def memory_limit_bytes() -> float:
    """The cgroup memory limit of this process where one is set, else the machine's RAM."""
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(ram, float(text))
    return ram


def measure_cpu(n: int = 512, copy_mib: int = 64) -> CPUMeasurement:
    """Measure this CPU on one thread (the setting is restored)."""
    begin, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n**3 / _timed(lambda: a @ b, 3)
        src = torch.ones(copy_mib * 2**20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy = 2 * src.numel() / _timed(lambda: dst.copy_(src), 3)
    finally:
        torch.set_num_threads(threads)
    return CPUMeasurement(flops, copy, memory_limit_bytes(), time.perf_counter() - begin)


def cpu_profile(measured: CPUMeasurement, name: str, ranks: int) -> HardwareProfile:
    """The profile of one of ``ranks`` CPU ranks sharing this machine: rates of one rank
    running alone, memory split between them, links at the copy rate (gloo between local
    processes goes through memory); efficiencies as ``tools/calibrate.py`` writes them."""
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else os.cpu_count() or 1)
    copy_gb = measured.copy_bytes_per_s / 1e9
    return HardwareProfile(
        name=name, peak_tflops=measured.flops_per_s / 1e12, hbm_gb_per_s=copy_gb,
        memory_gib=measured.memory_bytes / 2**30 / max(1, ranks),
        intra_node_gbps=copy_gb * 8, inter_node_gbps=copy_gb * 8, host_gb_per_s=copy_gb / 2,
        compute_efficiency=0.5, memory_efficiency=1.0, link_efficiency=1.0,
        collective_latency_s=CPU_COLLECTIVE_LATENCY_S, host_cores=cores,
        source=f"measured by megatron_rlhf.planner.local_profile on {socket.gethostname()} "
               f"in {measured.seconds:.2f} s ({cores:g} cores, {ranks} ranks sharing them)")


def cached_cpu_profile(ranks: int, cache_dir: str | Path | None = None
                       ) -> tuple[HardwareProfile, Path, bool]:
    """This machine's CPU profile for ``ranks`` ranks: the cached one, or measured and cached.

    Returns:
        The profile, its cache file, and whether it was measured now.
    """
    key = hashlib.sha256(f"{socket.gethostname()}:{ranks}".encode()).hexdigest()[:16]
    directory = Path(cache_dir or PROFILE_CACHE_DIR).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank measures; the others read its file
        if path.is_file():
            return load_profile(path), path, False
        profile = cpu_profile(measure_cpu(), f"cpu-{key}", ranks)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
        os.replace(temp, path)
        return profile, path, True


def pool_profiles(cluster: ClusterSpec, profile: str | Path | None = None,
                  cache_dir: str | Path | None = None
                  ) -> tuple[HardwareProfile | Mapping[str, HardwareProfile] | None, list[str]]:
    """The ``profiles`` argument of the planner (``hardware.resolve_profiles``) for a run, and
    one line per measured or cached pool profile saying which (also logged).

    Args:
        cluster: the run's pools.
        profile: a profile name or JSON path for every pool (``--profile``,
            ``placement.replan.profile``); None: each pool's shipped profile, and for a
            one-node ``local`` pool without CUDA this CPU's (:func:`cached_cpu_profile`).
        cache_dir: where measured profiles are cached; None: :data:`PROFILE_CACHE_DIR`.
    """
    if profile:
        return load_profile(profile), []
    shipped = {name.lower() for name in shipped_profiles()}
    measured, notes = {}, []
    for pool in cluster.pools:
        if (pool.kind == LOCAL_POOL and pool.kind.lower() not in shipped and pool.nodes == 1
                and not torch.cuda.is_available()):
            found, path, now = cached_cpu_profile(pool.devices_per_node, cache_dir)
            notes.append(f"pool {pool.kind!r}: {'measured' if now else 'using cached'} CPU "
                         f"profile ({found.peak_tflops * 1e3:.1f} GFLOP/s, "
                         f"{found.hbm_gb_per_s:.1f} GB/s, {found.memory_gib:.1f} GiB per rank) "
                         f"{'cached at' if now else 'from'} {path}")
            logger.info("%s", notes[-1])
            measured[pool.kind] = found
    return measured or None, notes
