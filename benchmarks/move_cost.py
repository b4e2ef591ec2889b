"""What an in-job move costs against a step: the tiny PPO run moved once, from flattening to
separation, in the same run.

    python benchmarks/move_cost.py                       # 4 ranks, examples/ppo_tiny.yaml
    python benchmarks/move_cost.py --ranks 2 --move-after 3 --steps 8
    python benchmarks/move_cost.py --profile-dir /tmp/move-prof   # cProfile of every rank

One run of ``examples/ppo_tiny.yaml`` under ``torchrun --standalone`` (one thread per rank)
with ``placement.replan.move=true``, forced to move to separation after step ``--move-after``
(``testing.run_hooks.forcing_moves``), whatever the planner predicts. Prints one JSON line: the
move's seconds per part and in all (from ``plan_history.jsonl``: the largest over the ranks),
its state's path (``memory``: shards handed over between the ranks; ``disk``: files), the
median step seconds before the move (steps 1 to ``--move-after``: step 0 holds the first calls)
and after it (the first step after the move apart: its models' first calls), the ratio of the
move to each, the run's start-up build seconds (what the first move's estimate scales) and that
estimate.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rlhf.planner.replan import MOVE_PARTS_PER_BUILD  # noqa: E402

CONFIG = REPO / "examples" / "ppo_tiny.yaml"
PARTS = ("save_s", "teardown_s", "build_s", "load_s")


def worker(args: argparse.Namespace) -> None:
    """One rank of the run (under torchrun)."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.testing.run_hooks import forcing_moves

    config = load_config(RunConfig, CONFIG, [
        f"run_dir={args.out / 'run'}", f"steps={args.steps}", "evaluation.num_prompts=0",
        "placement.replan.interval_steps=1", "placement.replan.warmup_steps=0",
        f"placement.replan.profile={args.out / 'profile.json'}", "placement.replan.move=true",
        *args.set])
    profiler = cProfile.Profile() if args.profile_dir else None
    with forcing_moves({args.move_after: "separation"}):
        if profiler is None:
            run_ppo(config)
        else:
            profiler.runcall(run_ppo, config)
    if profiler is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(args.profile_dir / f"rank_{os.environ['RANK']}.prof")


def summary(out: Path, move_after: int) -> dict:
    """The move's parts and the steps around it, from the run's files."""
    run_dir = out / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [move] = [json.loads(line)["moved"] for line in
              (run_dir / "plan_history.jsonl").read_text().splitlines() if '"moved"' in line]
    before = statistics.median(r["step_seconds"] for r in records[1:move_after + 1])
    after = statistics.median(r["step_seconds"] for r in records[move_after + 2:])
    total = move["move_seconds"]
    estimate = move["first_move_estimate"]
    return {"move_s": round(total, 4), **{key: round(move[key], 4) for key in PARTS},
            "state": move["state"], "step_s_before": round(before, 4),
            "step_s_after": round(after, 4),
            "first_step_after_s": round(records[move_after + 1]["step_seconds"], 4),
            "move_over_step_before": round(total / before, 2),
            "move_over_step_after": round(total / after, 2),
            "startup_build_s": round(estimate["build_s"] / MOVE_PARTS_PER_BUILD["build_s"], 4),
            "first_move_estimate_s": round(sum(estimate.values()), 4),
            "from": move["from"], "to": move["to"], "steps": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--move-after", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], help="a dotted override")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.out = args.out or Path(tempfile.mkdtemp(prefix="move_cost-"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps({
        "name": "local", "peak_tflops": 0.05, "hbm_gb_per_s": 10.0, "memory_gib": 8.0,
        "intra_node_gbps": 10.0, "inter_node_gbps": 10.0, "host_gb_per_s": 5.0,
        "host_cores": 2}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.ranks), __file__, "--worker", "--out", str(args.out), "--steps",
               str(args.steps), "--move-after", str(args.move_after),
               *(["--profile-dir", str(args.profile_dir)] if args.profile_dir else []),
               *[f"--set={override}" for override in args.set]]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with (args.out / "run.log").open("w") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"the run exited {done.returncode}; see {args.out / 'run.log'}")
    print(json.dumps(summary(args.out, args.move_after)))


if __name__ == "__main__":
    main()
