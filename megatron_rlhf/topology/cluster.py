"""The machines a job runs on: pools of identical nodes, numbered pool by pool, node by node.

    cluster = ClusterSpec.homogeneous(nodes=16, devices_per_node=8)
    hetero = ClusterSpec(pools=(
        DevicePool("A100-80GB", nodes=1, devices_per_node=8, memory_gib=80, relative_speed=1.0),
        DevicePool("V100-32GB", nodes=2, devices_per_node=4, memory_gib=32, relative_speed=0.4),
    ))

Global rank ``r`` lives on the node and local device found by walking the pools in order: the
first pool's nodes hold ranks ``0 .. pool.devices - 1``, node by node, and so on. This is the order
torchrun gives ranks when the launcher lists the nodes pool by pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePool:
    """A set of identical nodes.

    Attributes:
        kind: name of the device kind, unique in the cluster (e.g. ``A100-80GB``).
        nodes: number of nodes in the pool.
        devices_per_node: accelerators (ranks) per node.
        memory_gib: memory of one device in GiB.
        relative_speed: throughput of one device relative to the cluster's reference device
            (1.0); the engine balances batch shares between pools by it.
        intra_node_gbps: device-to-device bandwidth inside a node (NVLink), Gbit/s.
        inter_node_gbps: bandwidth of one node to the network (InfiniBand/Ethernet), Gbit/s.
    """

    kind: str = "A100-80GB"
    nodes: int = 1
    devices_per_node: int = 8
    memory_gib: float = 80.0
    relative_speed: float = 1.0
    intra_node_gbps: float = 2400.0
    inter_node_gbps: float = 200.0

    def __post_init__(self) -> None:
        if not self.kind or ":" in self.kind:
            raise ValueError(f"pool.kind={self.kind!r} must be a non-empty name without ':'")
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"pool {self.kind!r}: {name}={value!r} must be an integer >= 1")
        for name in ("memory_gib", "relative_speed", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"pool {self.kind!r}: {name}={getattr(self, name)!r} must be positive"
                )

    @property
    def devices(self) -> int:
        """Number of devices in the pool."""
        return self.nodes * self.devices_per_node

    @classmethod
    def parse(cls, text: str) -> DevicePool:
        """Read ``KIND:NODESxDEVICES[:MEMORY_GIB[:RELATIVE_SPEED]]``, e.g. ``V100-32GB:2x4:32:0.4``.

        Raises:
            ValueError: the text does not have that form.
        """
        parts = text.split(":")
        shape = parts[1].lower().split("x") if len(parts) >= 2 else []
        if not 2 <= len(parts) <= 4 or len(shape) != 2 or not all(s.isdigit() for s in shape):
            raise ValueError(
                f"pool {text!r} must read KIND:NODESxDEVICES[:MEMORY_GIB[:RELATIVE_SPEED]], "
                "e.g. V100-32GB:2x4:32:0.4"
            )
        extra = {}
        if len(parts) >= 3:
            extra["memory_gib"] = float(parts[2])
        if len(parts) == 4:
            extra["relative_speed"] = float(parts[3])
        return cls(parts[0], nodes=int(shape[0]), devices_per_node=int(shape[1]), **extra)


@dataclass(frozen=True)
class NodeInfo:
    """One node of the cluster.

    Attributes:
        index: global node index (pool by pool).
        pool_index: index of the node's pool in ``ClusterSpec.pools``.
        first_rank: global rank of the node's first device.
        size: devices on the node.
    """

    index: int
    pool_index: int
    first_rank: int
    size: int

    @property
    def ranks(self) -> range:
        """The node's global ranks."""
        return range(self.first_rank, self.first_rank + self.size)


@dataclass(frozen=True)
class DeviceLocation:
    """Where one global rank lives: pool, node and device index inside the node."""

    pool_index: int
    node: int
    local_rank: int


@dataclass(frozen=True)
class ClusterSpec:
    """The whole cluster: one or more pools, ranks numbered pool by pool, node by node.

    Attributes:
        pools: the device pools, in rank order. A list is accepted and stored as a tuple.
    """

    pools: tuple[DevicePool, ...] = (DevicePool(),)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        if not self.pools:
            raise ValueError("cluster.pools is empty: give at least one DevicePool")
        kinds = [pool.kind for pool in self.pools]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"cluster.pools kinds {kinds} repeat: give each pool its own kind")

    @classmethod
    def homogeneous(cls, nodes: int, devices_per_node: int, kind: str = "A100-80GB",
                    memory_gib: float = 80.0) -> ClusterSpec:
        """A cluster of ``nodes`` identical nodes."""
        return cls((DevicePool(kind, nodes=nodes, devices_per_node=devices_per_node,
                               memory_gib=memory_gib),))

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks)."""
        return sum(pool.devices for pool in self.pools)

    @property
    def num_nodes(self) -> int:
        """Total number of nodes."""
        return sum(pool.nodes for pool in self.pools)

    @property
    def is_heterogeneous(self) -> bool:
        """Whether the cluster has more than one pool."""
        return len(self.pools) > 1

    def pool_index(self, kind: str) -> int:
        """Index of the pool named ``kind``.

        Raises:
            ValueError: no pool has that kind.
        """
        for index, pool in enumerate(self.pools):
            if pool.kind == kind:
                return index
        raise ValueError(
            f"no pool of kind {kind!r}: the cluster has {[p.kind for p in self.pools]}"
        )

    def nodes(self) -> list[NodeInfo]:
        """Every node, in rank order."""
        result: list[NodeInfo] = []
        first_rank = 0
        for pool_index, pool in enumerate(self.pools):
            for _ in range(pool.nodes):
                result.append(NodeInfo(len(result), pool_index, first_rank, pool.devices_per_node))
                first_rank += pool.devices_per_node
        return result

    def locate(self, rank: int) -> DeviceLocation:
        """The pool, node and local device of a global rank.

        Raises:
            ValueError: the rank is outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the cluster's [0, {self.world_size})")
        node_offset = 0
        for pool_index, pool in enumerate(self.pools):
            if rank < pool.devices:
                node, local = divmod(rank, pool.devices_per_node)
                return DeviceLocation(pool_index, node_offset + node, local)
            rank -= pool.devices
            node_offset += pool.nodes
        raise AssertionError("unreachable: rank was checked against world_size")

    def to_dict(self) -> dict:
        """JSON-ready description."""
        return {"pools": [dict(vars(pool)) for pool in self.pools]}


def cluster_from_environment(pools: list[DevicePool] | None = None) -> ClusterSpec:
    """The configured pools, or one pool shaped like torchrun's world (nodes x local ranks)
    whose memory is this machine's (:func:`local_device_memory_gib`)."""
    if pools:
        return ClusterSpec(tuple(pools))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return ClusterSpec((DevicePool("local", nodes=world // local, devices_per_node=local,
                                   memory_gib=local_device_memory_gib(local)),))


def local_device_memory_gib(local_ranks: int) -> float:
    """The memory one of this machine's ``local_ranks`` ranks has, GiB (one decimal): its CUDA
    device's, or without CUDA the host's RAM shared by the ranks (an unknown amount: the
    ``DevicePool`` default)."""
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # sysconf lacks these names on some systems
        return DevicePool.memory_gib
    return round(host / 2**30 / local_ranks, 1)
