"""Cluster and model specs, placement plans, rank grids and per-model process groups.

The pure planning API is importable without Megatron or a process group::

    from megatron_rlhf.topology import ClusterSpec, PlacementConfig, plan_placement

Building the groups at run time imports Megatron-Core, so it lives in its own module::

    from megatron_rlhf.topology.groups import build_process_groups
"""

from __future__ import annotations

from megatron_rlhf.topology.cluster import ClusterSpec, DeviceLocation, DevicePool, NodeInfo
from megatron_rlhf.topology.grid import DIM_NAMES, GridCoords
from megatron_rlhf.topology.models import (
    ARCH_PRESETS,
    ROLES,
    ArchSpec,
    ModelSpec,
    arch_preset,
)
from megatron_rlhf.topology.placement import plan_placement, resolve_models
from megatron_rlhf.topology.placement_config import (
    STRATEGIES,
    ParallelOverride,
    PlacementConfig,
)
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan
from megatron_rlhf.topology.validate import validate_plan

__all__ = [
    "ARCH_PRESETS",
    "DIM_NAMES",
    "ROLES",
    "STRATEGIES",
    "ArchSpec",
    "ClusterSpec",
    "DeviceLocation",
    "DevicePool",
    "GridCoords",
    "ModelPlacement",
    "ModelSpec",
    "NodeInfo",
    "ParallelOverride",
    "PlacementConfig",
    "PlacementPlan",
    "arch_preset",
    "plan_placement",
    "resolve_models",
    "validate_plan",
]
