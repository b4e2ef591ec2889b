"""Cost model of a PPO step and automatic placement.

    from megatron_rlhf.planner import RolloutSpec, auto_place, homogeneous_cluster, predict_step

    cluster = homogeneous_cluster("A100-80GB", nodes=4, devices_per_node=8)
    ranked = auto_place(cluster, "llama-13b", RolloutSpec(batch=1024))
    prediction = predict_step(ranked[0].plan, RolloutSpec(batch=1024))

Pure Python on top of ``topology`` (no torch, no process group). See ``docs/planner.md``.
"""

from __future__ import annotations

from megatron_rlhf.planner.evaluate import (
    RankingComparison,
    compare_rankings,
    compare_stage_times,
    within_factor,
)
from megatron_rlhf.planner.hardware import (
    HardwareProfile,
    homogeneous_cluster,
    load_profile,
    resolve_profiles,
    shipped_profiles,
)
from megatron_rlhf.planner.memory_fit import (
    MEMORY_OPTIONS,
    MemoryOptions,
    MemoryReport,
    RoleMemory,
    fit_memory,
    plan_memory,
)
from megatron_rlhf.planner.predict import BOTTLENECKS, STAGES, StepPrediction, predict_step
from megatron_rlhf.planner.search import (
    RankedCandidate,
    SearchSpace,
    auto_place,
    candidate_configs,
    describe,
    explain_choice,
)
from megatron_rlhf.planner.workload import AnswerLengths, RolloutSpec

__all__ = [
    "BOTTLENECKS",
    "MEMORY_OPTIONS",
    "STAGES",
    "AnswerLengths",
    "HardwareProfile",
    "MemoryOptions",
    "MemoryReport",
    "RankedCandidate",
    "RankingComparison",
    "RoleMemory",
    "RolloutSpec",
    "SearchSpace",
    "StepPrediction",
    "auto_place",
    "candidate_configs",
    "compare_rankings",
    "compare_stage_times",
    "describe",
    "explain_choice",
    "fit_memory",
    "homogeneous_cluster",
    "load_profile",
    "plan_memory",
    "predict_step",
    "resolve_profiles",
    "shipped_profiles",
    "within_factor",
]
