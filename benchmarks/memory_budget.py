"""The largest rollout batch that fits a per-rank memory budget, with every model resident and
with every model offloaded between stages, per placement of the tiny CPU configuration.

    python benchmarks/memory_budget.py --budget-mib 8

One JSON line per placement. The peaks are ``engine.run.stage_memory.stage_peaks`` over the planner's
per-model bytes (``tests/engine/test_memory.py`` holds them to the engine's recorded peaks on the
CPU): model state and the KV cache of generation, which is what grows with the batch; activations
are not counted. ``examples/ppo_tiny.yaml`` on 4 ranks in bf16 (the planner's bytes are bf16);
``rollout.prompts_per_step`` steps through the values the placement accepts. Prompts and
responses are taken at full length (``max_prompt_length``, ``max_new_tokens``): the shipped
prompts are shorter, so a run's KV cache stays under the planned one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RANKS = 4
PLACEMENTS = ("flattening", "interleaving", "interleaving2", "separation")
BASE = ["models.params_dtype=bfloat16"]


def config_for(placement: str, prompts: int):
    """The run configuration, or None when the placement refuses that batch."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool

    overrides = BASE + [f"placement.strategy={placement}", f"rollout.prompts_per_step={prompts}"]
    try:
        config = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml", overrides)
        return config, make_plan(config, ClusterSpec((DevicePool("local", 1, RANKS),)))
    except ValueError:
        return None


def peak_bytes(placement: str, prompts: int, offload: str) -> float | None:
    """The predicted largest stage peak over the ranks (None: the batch is refused)."""
    from megatron_rlhf.engine.run.stage_memory import planner_role_bytes, stage_peaks

    planned = config_for(placement, prompts)
    if planned is None:
        return None
    config, plan = planned
    roles = planner_role_bytes(plan, config)
    offloaded = set(plan.roles) if offload == "always" else set()
    return max(max(stages.values()) for stages in stage_peaks(plan, roles, offloaded).values())


def largest_batch(placement: str, offload: str, budget: float) -> tuple[int, float]:
    """The largest accepted ``prompts_per_step`` whose peak fits ``budget``, and that peak
    (0 and the smallest batch's peak when none fits)."""
    unit = next(p for p in range(1, 1025) if peak_bytes(placement, p, offload) is not None)

    def fits(multiple: int) -> bool:
        return peak_bytes(placement, multiple * unit, offload) <= budget

    if not fits(1):
        return 0, peak_bytes(placement, unit, offload)
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * unit, peak_bytes(placement, low * unit, offload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=8.0, help="memory of one rank, MiB")
    args = parser.parse_args()
    if args.budget_mib <= 0:
        parser.error(f"--budget-mib {args.budget_mib}: give a positive budget")
    budget = args.budget_mib * 2**20
    for placement in PLACEMENTS:
        line: dict = {"placement": placement, "ranks": RANKS, "budget_mib": args.budget_mib}
        for offload in ("never", "always"):
            prompts, peak = largest_batch(placement, offload, budget)
            line[f"largest_prompts_per_step_offload_{offload}"] = prompts
            line[f"planned_peak_mib_offload_{offload}"] = round(peak / 2**20, 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
