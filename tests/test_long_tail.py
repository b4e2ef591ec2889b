"""The long-tail workload (examples/long_tail) plans on 4 ranks under each placement
benchmarks/long_tail.py runs, and the benchmark's idle time reads a timeline right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.topology.cluster import ClusterSpec

REPO = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location("long_tail", REPO / "benchmarks" /
                                                  "long_tail.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("run", sorted(_benchmark().RUNS))
def test_the_workload_plans_on_four_ranks(run: str) -> None:
    benchmark = _benchmark()
    config = load_config(RunConfig, benchmark.CONFIG, benchmark.RUNS[run])
    plan = make_plan(config, ClusterSpec.homogeneous(1, 4))
    assert {rank for role in plan.roles for rank in plan[role].ranks} == set(range(4))
    assert "critic" not in plan.roles, "GRPO trains no critic"
    stops = [ids[0] for ids in config.generation.stop_sequences]
    assert len(set(stops)) == 16 and not config.generation.stop_at_eos


def test_idle_time_counts_compute_spans_once_after_the_first_step() -> None:
    def span(rank: int, stage: str, start: float, end: float) -> dict:
        return {"ph": "X", "pid": rank, "cat": stage, "ts": start, "dur": end - start}

    events = [
        span(0, "train", 0, 10), span(0, "sync_weights", 10, 20),  # step 0 ends at 20
        span(0, "train", 30, 60), span(0, "experience", 50, 70),  # busy 40 of 100
        span(0, "transfer", 70, 120),  # waiting
        span(1, "generate", 0, 40), span(1, "generate", 90, 120),  # busy 20 + 30 of 100
        {"ph": "M", "pid": 1, "name": "process_name"},
    ]
    benchmark = _benchmark()
    assert benchmark.busy_seconds([(30, 60), (50, 70)], 20, 120) == 40
    assert benchmark.idle_fractions(events) == {"generating": 0.5, "others": 0.6}
