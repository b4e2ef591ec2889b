"""What one device can do: peak compute, memory bandwidth, memory, links, and how much of it a
PPO step really gets.

    profile = load_profile("A100-80GB")             # a shipped profile, by name
    profile = load_profile("runs/cpu-local.json")   # one written by tools/calibrate.py
    cluster = homogeneous_cluster(profile, nodes=16, devices_per_node=8)

Peaks come from public specification sheets (shipped profiles, see ``docs/planner.md``) or from
``tools/calibrate.py`` (measured micro-benchmarks). The efficiency factors say which fraction of a
peak a whole model step reaches; they are assumptions, written in each profile, that calibration
against measured steps should refine (``planner.evaluate``).

Links: the cluster is the source of truth for how nodes are wired (``DevicePool.intra_node_gbps``
and ``inter_node_gbps``). A profile carries the figures of its reference system (e.g. a DGX node)
so that ``homogeneous_cluster`` and ``pool_from_profile`` can build pools with them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
"""Where the shipped profiles live, one ``<name>.json`` each."""

_FRACTIONS = ("compute_efficiency", "memory_efficiency", "link_efficiency",
              "usable_memory_fraction")


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind, as the cost model sees it.

    Attributes:
        name: device kind; a pool whose ``kind`` equals it uses this profile.
        peak_tflops: dense bf16 tensor-core peak, TFLOP/s (fp16 on devices without bf16).
        hbm_gb_per_s: device memory bandwidth, GB/s (1e9 bytes/s).
        memory_gib: device memory, GiB.
        intra_node_gbps: device-to-device bandwidth inside a node, one direction, Gbit/s.
        inter_node_gbps: network bandwidth of one node (all its NICs), one direction, Gbit/s.
        host_gb_per_s: device-to-host bandwidth (PCIe), one direction, GB/s; prices offloading.
        host_memory_gib: host memory of one node, GiB, of which ``usable_memory_fraction`` may
            hold the states offloaded there; 0: not known, and the planner neither checks host
            memory nor offloads optimizer state to the host.
        host_adam_gparams_per_s: parameters per second, in billions, that the host's Adam
            updates for one device's offloaded optimizer shard (the node's cores shared by its
            devices); prices optimizer CPU offload.
        compute_efficiency: fraction of ``peak_tflops`` reached by transformer forward/backward
            passes (model FLOPs utilisation, MFU).
        memory_efficiency: fraction of ``hbm_gb_per_s`` reached by a decode step.
        link_efficiency: fraction of a link's bandwidth a collective reaches (bus bandwidth).
        layer_latency_s: fixed cost of running one transformer layer once (kernel launches,
            framework overhead), whatever its size; dominates decoding of small batches.
        call_latency_s: fixed cost of one model call beyond its layers (embedding, final norm,
            output layer; for a decode step also the sampling), per forward-equivalent pass
            (a backward counts two, as for ``layer_latency_s``).
        collective_latency_s: fixed cost of one collective or point-to-point call.
        step_latency_s: fixed cost of one optimizer step of a model beyond its passes (zeroing
            gradient buffers, the reduction and optimizer calls), per step.
        host_cores: 0 when every device has its own compute (GPUs); for CPU ranks, the cores
            the ranks of one node share: rates are per rank running alone, and the schedule
            slows ranks down when more of them are busy than there are cores.
        usable_memory_fraction: share of ``memory_gib`` that models may use (the rest: CUDA
            context, communication buffers, fragmentation).
        source: where the numbers come from (specification sheet, calibration run).
    """

    name: str
    peak_tflops: float
    hbm_gb_per_s: float
    memory_gib: float
    intra_node_gbps: float
    inter_node_gbps: float
    host_gb_per_s: float
    compute_efficiency: float = 0.4
    memory_efficiency: float = 0.6
    link_efficiency: float = 0.7
    layer_latency_s: float = 2e-4
    call_latency_s: float = 2e-4
    collective_latency_s: float = 8e-6
    step_latency_s: float = 1e-3
    host_cores: float = 0.0
    usable_memory_fraction: float = 0.9
    host_memory_gib: float = 0.0
    host_adam_gparams_per_s: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name:
            raise ValueError(f"profile.name={self.name!r} must be a non-empty name without ':'")
        for field in fields(self):
            if field.name in ("name", "source"):
                continue
            value = getattr(self, field.name)
            may_be_zero = (field.name.endswith("latency_s")
                           or field.name in ("host_cores", "host_memory_gib"))
            if not isinstance(value, int | float) or value < 0 or (value == 0 and not may_be_zero):
                raise ValueError(f"profile {self.name!r}: {field.name}={value!r} must be positive")
            if field.name in _FRACTIONS and value > 1:
                raise ValueError(
                    f"profile {self.name!r}: {field.name}={value} must be in (0, 1]: it is the "
                    "fraction of a peak that is reached"
                )

    @property
    def flops_per_s(self) -> float:
        """Sustained FLOP/s of model passes: ``peak_tflops * 1e12 * compute_efficiency``."""
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        """Sustained device-memory bytes/s of decoding: ``hbm_gb_per_s * 1e9 * efficiency``."""
        return self.hbm_gb_per_s * 1e9 * self.memory_efficiency

    @property
    def host_bytes_per_s(self) -> float:
        """Sustained device-to-host bytes/s: ``host_gb_per_s * 1e9 * link_efficiency``."""
        return self.host_gb_per_s * 1e9 * self.link_efficiency

    @property
    def host_adam_params_per_s(self) -> float:
        """Parameters per second the host's Adam updates for one device:
        ``host_adam_gparams_per_s * 1e9``."""
        return self.host_adam_gparams_per_s * 1e9

    @property
    def host_usable_bytes(self) -> float:
        """Bytes of one node's host memory that offloaded states may use:
        ``host_memory_gib * usable_memory_fraction``."""
        return self.host_memory_gib * 1024**3 * self.usable_memory_fraction

    @property
    def usable_bytes(self) -> float:
        """Bytes of one device that models may use: ``memory_gib * usable_memory_fraction``."""
        return self.memory_gib * 1024**3 * self.usable_memory_fraction

    def pool(self, nodes: int, devices_per_node: int, relative_speed: float = 1.0) -> DevicePool:
        """A pool of these devices with the profile's memory and link figures."""
        return DevicePool(self.name, nodes=nodes, devices_per_node=devices_per_node,
                          memory_gib=self.memory_gib, relative_speed=relative_speed,
                          intra_node_gbps=self.intra_node_gbps,
                          inter_node_gbps=self.inter_node_gbps)

    def to_dict(self) -> dict:
        """JSON-ready description (the format of the profile files)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> HardwareProfile:
        """Read a profile written by ``to_dict``.

        Raises:
            ValueError: unknown or missing keys, or invalid values.
        """
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile has unknown keys {unknown}: use keys from {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as error:
            raise ValueError(f"profile is incomplete ({error}): give every field without a "
                             "default, see megatron_rlhf/planner/profiles/A100-80GB.json") from None


def shipped_profiles() -> dict[str, HardwareProfile]:
    """Every profile under ``PROFILE_DIR``, keyed by name."""
    profiles = (HardwareProfile.from_dict(json.loads(path.read_text()))
                for path in sorted(PROFILE_DIR.glob("*.json")))
    return {profile.name: profile for profile in profiles}


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (case-insensitive), or a profile JSON file by path.

    Raises:
        ValueError: neither a shipped name nor a readable file.
    """
    shipped = {name.lower(): profile for name, profile in shipped_profiles().items()}
    if str(name_or_path).lower() in shipped:
        return shipped[str(name_or_path).lower()]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"profile {str(name_or_path)!r} is neither a shipped profile "
            f"{sorted(shipped_profiles())} nor a file: write one with tools/calibrate.py"
        )
    return HardwareProfile.from_dict(json.loads(path.read_text()))


def homogeneous_cluster(profile: HardwareProfile | str, nodes: int,
                        devices_per_node: int) -> ClusterSpec:
    """A one-pool cluster of ``profile`` devices with its memory and link figures."""
    if isinstance(profile, str):
        profile = load_profile(profile)
    return ClusterSpec((profile.pool(nodes, devices_per_node),))


def resolve_profiles(cluster: ClusterSpec,
                     profiles: Mapping[str, HardwareProfile] | HardwareProfile | None = None
                     ) -> tuple[HardwareProfile, ...]:
    """The profile of every pool, in pool order.

    Args:
        cluster: the pools.
        profiles: one profile for every pool, or profiles keyed by pool kind (pools not named
            fall back to the shipped profile of their kind), or None for shipped profiles only.

    Raises:
        ValueError: a pool's kind has no profile.
    """
    if isinstance(profiles, HardwareProfile):
        return tuple(profiles for _ in cluster.pools)
    given = dict(profiles or {})
    shipped = {name.lower(): profile for name, profile in shipped_profiles().items()}
    result = []
    for pool in cluster.pools:
        profile = given.get(pool.kind) or shipped.get(pool.kind.lower())
        if profile is None:
            raise ValueError(
                f"pool {pool.kind!r} has no hardware profile: name the pool after one of "
                f"{sorted(shipped_profiles())} or give one (--profile NAME|PATH, for "
                "re-planning placement.replan.profile; tools/calibrate.py writes one)"
            )
        result.append(profile)
    return tuple(result)
