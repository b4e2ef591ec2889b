"""Every placement on 4 CPU ranks at one tiny configuration: speed, stage times, idle, memory.

    python benchmarks/placements.py                  # all placements, one JSON line each
    python benchmarks/placements.py --steps 6 --repeats 5 --memory-budget-gib 2

Each placement runs under torchrun (4 gloo ranks), ``--repeats`` times, the placements taking
turns so that a slow spell of the machine touches all of them. Per placement it prints the
median samples/s over the runs (measured steps after a warm-up step, batch B) with the lowest and
highest, and from the median run: seconds per stage and step (see ``stage_seconds``), the
idle fraction of
each rank (1 - time in compute stages / wall time; waiting inside transfers and weight sync
counts as idle), the peak resident memory of each rank, the bytes of model state (weights,
gradient buffers, optimizer state) each rank holds, measured from its tensors, and the largest
rollout batch that fits ``--memory-budget-gib`` per rank: (budget - model state) / the bytes a
rollout row adds on that rank (KV cache of the generating replicas, divided over their DP size,
plus the experience rows every trainer rank keeps), minimised over ranks.

A last line compares the planner's prediction with the measurement: predicted and measured
ranking of the placements (Kendall tau; the pairs whose runs overlap, which the measurement
cannot order; whether every other pair is predicted in the measured order) and
predicted/measured stage times, using a profile of this machine measured by
``tools/calibrate.py --ranks 4`` (or ``--profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_rlhf.planner.schedule import covered_seconds

REPO = Path(__file__).resolve().parent.parent
COMPUTE_STAGES = {"generate", "experience", "advantages", "train"}
PLANNER_STAGES = {"generate": "generation", "experience": "experience", "train": "training",
                  "transfer": "transfer", "sync_weights": "sync"}
SLOWEST_RANK_STAGES = {"generate", "experience", "advantages"}
PLACEMENTS = {
    "flattening": ["placement.strategy=flattening"],
    "interleaving": ["placement.strategy=interleaving"],
    "interleaving2": ["placement.strategy=interleaving2"],
    "separation": ["placement.strategy=separation"],
    "separation-async": ["placement.strategy=separation", "rollout.async_rollout=true"],
}


def worker(args: argparse.Namespace) -> None:
    """One placement on this torchrun world; rank 0 writes the per-rank figures to ``--out``."""
    import torch.distributed as dist

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.run.runner import load_prompts, rule_reward_for
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.models.tokenizer import Tokenizer
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.runtime.context import RunContext
    from megatron_rlhf.runtime.tracing import Tracer
    from megatron_rlhf.topology.cluster import cluster_from_environment

    overrides = PLACEMENTS[args.placement] + [
        f"rollout.prompts_per_step={args.batch}", f"steps={args.steps + 1}", "runtime.log_level=WARNING"]
    config = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml", overrides)
    tokenizer = Tokenizer.from_config(config.tokenizer)
    prompts = load_prompts(config, tokenizer)
    plan = make_plan(config, cluster_from_environment(config.cluster.pools))
    initialize_runtime(config.runtime)
    context = RunContext()
    engine = build_engine(config, plan, tokenizer.eos_id, tokenizer.pad_id, context=context)
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward,
                         config.runtime.seed, prompts.batch, config.steps,
                         rule_reward_for(config, tokenizer))
    algorithm.step(0)  # warm-up: first-touch allocations, optimizer state
    dist.barrier()
    tracer = context.tracer = Tracer(enabled=True)
    start = time.time()
    for step in range(1, config.steps):
        algorithm.step(step)
    dist.barrier()
    wall = time.time() - start
    mine = {"stage_seconds": tracer.seconds_by_stage(),
            "busy": tracer.busy_seconds(COMPUTE_STAGES),
            "model_state_bytes": sum(worker.offloader.resident_bytes()
                                     for worker in engine.workers.values()),
            "row_bytes": row_bytes(engine, config),
            "spans": [(span.stage, span.model, span.start, span.end) for span in tracer.spans],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "roles": list(plan.roles_on(dist.get_rank()))}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"wall": wall, "steps": args.steps,
                                              "batch": args.batch, "ranks": gathered}))


def row_bytes(engine, config) -> float:
    """Bytes one more rollout row costs this rank: KV cache share plus kept experience rows."""
    p, r = config.rollout.max_prompt_length, config.generation.max_new_tokens
    total = 0.0
    for role in engine.workers:
        placement = engine.plan[role]
        if role == engine.policy_for_inference:
            arch, kv_heads = placement.spec.arch, placement.spec.arch.num_query_groups
            per_layer = 2 * kv_heads * (arch.hidden_size // arch.num_attention_heads) * 4
            total += (arch.num_layers // placement.pp) * per_layer // placement.tp * (p + r) \
                / placement.dp
    if any(role in engine.workers for role in engine.trainable_roles):
        # ids and masks (int64) over P+R, response mask (int64) and 8 float32 fields over R.
        total += 2 * 8 * (p + r) + 8 * r + 8 * 4 * r
    return total


def run_placement(name: str, batch: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4", __file__, "--worker", "--placement", name,
                   "--batch", str(batch), "--steps", str(steps), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines()
                      if "Error" in line or "error" in line or "what()" in line]
            raise RuntimeError(f"{name} at batch {batch} failed:\n" + "\n".join(errors[-20:]))
        return json.loads(out.read_text())


def stage_seconds(ranks: list[dict]) -> dict[str, float]:
    """Seconds of each stage, comparable with the planner's time of the stage's tasks.

    Generation and experience passes do not wait for other ranks (TP 1 here): the stage takes as
    long as its slowest rank (the union of that rank's spans), as the planner prices the slowest
    replica. Training, transfers and weight sync meet other ranks in collectives, and a rank that
    gets there first waits inside its span (a shadow waits in the weight sync while the trainers
    train): each occurrence (the k-th span of a stage and model on every rank that has one) runs
    from the last rank's arrival to the last rank's exit, which leaves the waiting out; the stage
    takes the union of its occurrences (actor and critic training side by side count once).
    """
    seconds: dict[str, float] = {}
    for stage in sorted({name for rank in ranks for name, _, _, _ in rank["spans"]}):
        if stage in SLOWEST_RANK_STAGES:
            seconds[stage] = max(covered_seconds((begin, end) for name, _, begin, end
                                                 in rank["spans"] if name == stage)
                                 for rank in ranks)
            continue
        occurrences: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for rank in ranks:
            counts: dict[str, int] = {}
            for name, model, begin, end in rank["spans"]:
                if name == stage:
                    k = counts[model] = counts.get(model, -1) + 1
                    occurrences.setdefault((model, k), []).append((begin, end))
        seconds[stage] = covered_seconds((max(b for b, _ in spans), max(e for _, e in spans))
                                         for spans in occurrences.values())
    return seconds


def summarise(name: str, runs: list[dict], budget_gib: float) -> dict:
    """One JSON line for a placement: the median run's figures (the upper middle one for an even
    count of runs) and the lowest and highest samples/s."""
    rates = [run["batch"] * run["steps"] / run["wall"] for run in runs]
    run = runs[sorted(range(len(runs)), key=rates.__getitem__)[len(runs) // 2]]
    ranks = run["ranks"]
    per_step = {stage: round(seconds / run["steps"], 4)
                for stage, seconds in stage_seconds(ranks).items()}
    budget = budget_gib * 2**30
    fits = [int((budget - r["model_state_bytes"]) / r["row_bytes"]) for r in ranks if r["row_bytes"]]
    return {
        "placement": name,
        "samples_per_s": round(run["batch"] * run["steps"] / run["wall"], 2),
        "samples_per_s_range": [round(min(rates), 2), round(max(rates), 2)],
        "runs": len(runs),
        "seconds_per_step": round(run["wall"] / run["steps"], 3),
        "stage_seconds_per_step": per_step,
        "idle_fraction": [round(1 - r["busy"] / run["wall"], 3) for r in ranks],
        "roles": [r["roles"] for r in ranks],
        "peak_rss_gib": [round(r["peak_rss_gib"], 3) for r in ranks],
        "model_state_mib": [round(r["model_state_bytes"] / 2**20, 2) for r in ranks],
        "max_batch_at_budget": min(fits),
        "memory_budget_gib": budget_gib,
    }


def planner_comparison(results: dict[str, dict], batch: int, profile_path: Path) -> dict:
    """Predicted against measured samples/s ranking and stage times, on this machine's profile."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.planner import (
        RolloutSpec,
        compare_rankings,
        compare_stage_times,
        load_profile,
        predict_step,
    )
    from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool

    profile = load_profile(profile_path)
    cluster = ClusterSpec((DevicePool(profile.name, nodes=1, devices_per_node=4),))
    predicted, stage_ratios = {}, {}
    for name, measured in results.items():
        config = load_config(RunConfig, REPO / "examples" / "ppo_tiny.yaml",
                             PLACEMENTS[name] + [f"rollout.prompts_per_step={batch}"])
        rollout = RolloutSpec.from_run_config(config, overlap=config.rollout.async_rollout)
        prediction = predict_step(make_plan(config, cluster), rollout, profile)
        predicted[name] = prediction.samples_per_s
        stages = {PLANNER_STAGES[k]: v for k, v in measured["stage_seconds_per_step"].items()
                  if k in PLANNER_STAGES}
        stage_ratios[name] = {k: round(v, 2)
                              for k, v in compare_stage_times(prediction, stages).items()}
    report = compare_rankings(predicted, {n: r["samples_per_s"] for n, r in results.items()},
                              {n: tuple(r["samples_per_s_range"]) for n, r in results.items()})
    figures = {k: v for k, v in profile.to_dict().items() if k != "source"}
    return {"comparison": "planner_vs_measured", "profile": str(profile_path),
            "profile_figures": figures,
            "predicted_samples_per_s": {k: round(v, 2) for k, v in predicted.items()},
            "predicted_order": report.predicted_order, "measured_order": report.measured_order,
            "kendall_tau": round(report.kendall_tau, 3), "same_order": report.same_order,
            "ties": [list(pair) for pair in report.ties],
            "separable_agree": report.separable_agree,
            "predicted_over_measured_stage_seconds": stage_ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help="rollout batch B")
    parser.add_argument("--steps", type=int, default=4, help="measured steps after a warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each placement")
    parser.add_argument("--memory-budget-gib", type=float, default=0.01,
                        help="per-rank memory budget for the largest-batch estimate")
    parser.add_argument("--profile", type=Path,
                        help="planner profile of this machine (default: measure one now)")
    args = parser.parse_args()
    if args.worker:
        from megatron_rlhf.runtime.distributed import destroy_distributed

        try:
            worker(args)
        finally:
            destroy_distributed()
        return
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more runs per placement")
    runs: dict[str, list[dict]] = {name: [] for name in PLACEMENTS}
    for _ in range(args.repeats):
        for name in PLACEMENTS:
            runs[name].append(run_placement(name, args.batch, args.steps))
    results = {}
    for name in PLACEMENTS:
        results[name] = summarise(name, runs[name], args.memory_budget_gib)
        print(json.dumps(results[name]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.profile or Path(tmp) / "cpu-local.json"
        if args.profile is None:
            subprocess.run([sys.executable, str(REPO / "tools" / "calibrate.py"), "--ranks", "4",
                            "--out", str(profile)], check=True, cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(json.dumps(planner_comparison(results, args.batch, profile)), flush=True)


if __name__ == "__main__":
    main()
