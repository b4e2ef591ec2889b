"""The planner's predictions for NeMo-RL's published GRPO rows (docs/results/nemo-rl.md).

    python benchmarks/nemo_rl_compare.py                 # shipped H100 profile, then calibrated
    python benchmarks/nemo_rl_compare.py --json

Each row is ``run_ppo.py --plan-only`` (``engine.run.plan_only.plan_run``) on a config in
``benchmarks/nemo_rl/`` with the row's mean answer (``--answer-mean``); tokens/s/GPU is NeMo-RL's
definition, the step's prompt and answer tokens over the step time and the GPUs. The calibration
fits one number of the H100 profile, ``layer_latency_s`` (assumed, never measured on a GPU), so
that the first row's step time is NeMo-RL's, and predicts the other rows with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rlhf.config.loader import load_config  # noqa: E402
from megatron_rlhf.config.ppo_run import RunConfig  # noqa: E402
from megatron_rlhf.engine.run.plan_only import answer_lengths, plan_cluster, plan_run  # noqa: E402
from megatron_rlhf.planner import describe, load_profile  # noqa: E402

CONFIGS = REPO / "benchmarks" / "nemo_rl"
ROWS = (
    # label, config, overrides, placement auto, mean answer, NeMo-RL step s, tokens/s/GPU
    ("Llama-3.1-8B on-policy, 16 H100", "llama3.1-8b-grpo-2x8.yaml", (), False, 1060, 97.7, 1562),
    ("Llama-3.1-8B one-step-off, 16 H100", "llama3.1-8b-grpo-2x8.yaml",
     ("placement.strategy=separation", "rollout.async_rollout=true"), False, 1129, 74.6, 2161),
    ("Qwen3-30B-A3B on-policy, 32 H100", "qwen3-30b-a3b-grpo-4x8.yaml", (), False, 3154, 225.0,
     925),
    ("Llama-3.1-8B on-policy, auto", "llama3.1-8b-grpo-2x8.yaml", (), True, 1060, 97.7, 1562),
    ("Llama-3.1-8B one-step-off, auto", "llama3.1-8b-grpo-2x8.yaml",
     ("rollout.async_rollout=true",), True, 1129, 74.6, 2161),
)


def predict(row: tuple, profile_path: str) -> dict:
    """One row's prediction with the profile at ``profile_path``."""
    label, name, overrides, auto, mean, step, tokens = row
    config = load_config(RunConfig, CONFIGS / name, list(overrides))
    lengths = answer_lengths(config, mean=mean)
    run_plan = plan_run(config, plan_cluster(config), profile_path, auto=auto, lengths=lengths)
    p = run_plan.prediction
    gpus = run_plan.plan.cluster.world_size
    rows = run_plan.rollout.batch
    per_gpu = rows * (run_plan.rollout.prompt_length + mean) / p.step_seconds / gpus
    return {"row": label, "config": name, "overrides": list(overrides), "answer_mean": mean,
            "placement": describe(run_plan.plan), "fits": run_plan.fits,
            "predicted_step_s": round(p.step_seconds, 1), "measured_step_s": step,
            "step_ratio": round(p.step_seconds / step, 2),
            "predicted_tokens_per_s_per_gpu": round(per_gpu), "measured_tokens_per_s_per_gpu":
            tokens, "stages": {k: round(v, 1) for k, v in p.stage_seconds.items()},
            "pipelined": p.pipelined}


def with_profile(directory: Path, **changes: float) -> str:
    """The H100 profile with ``changes``, written as JSON; its path."""
    profile = dataclasses.replace(load_profile("H100-80GB"), **changes)
    path = directory / f"h100-{len(list(directory.iterdir()))}.json"
    path.write_text(json.dumps(profile.to_dict()))
    return str(path)


def calibrate(directory: Path, row: tuple, low: float = 0.0, high: float = 2e-4) -> float:
    """``layer_latency_s`` with which ``row``'s predicted step is its measured one (bisection;
    the bound nearest when it cannot be reached)."""
    def step(latency: float) -> float:
        return predict(row, with_profile(directory, layer_latency_s=latency))["predicted_step_s"]

    target = row[5]
    if step(low) >= target:
        return low
    if step(high) <= target:
        return high
    for _ in range(20):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < target else (low, mid)
    return (low + high) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        shipped = with_profile(directory)
        latency = calibrate(directory, ROWS[0])
        fitted = with_profile(directory, layer_latency_s=latency)
        results = {"shipped": [predict(row, shipped) for row in ROWS],
                   "calibrated_layer_latency_s": latency,
                   "calibrated": [predict(row, fitted) for row in ROWS]}
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"calibrated layer_latency_s = {latency:.3g} (shipped 2e-4) on: {ROWS[0][0]}")
    for key in ("shipped", "calibrated"):
        for r in results[key]:
            print(f"{key:10} {r['row']:38} {r['placement']} predicted {r['predicted_step_s']:7.1f}"
                  f" s vs {r['measured_step_s']:6.1f} s ({r['step_ratio']:.2f}x), "
                  f"{r['predicted_tokens_per_s_per_gpu']:5d} vs "
                  f"{r['measured_tokens_per_s_per_gpu']} tokens/s/GPU; stages {r['stages']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
