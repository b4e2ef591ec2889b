"""Whole runs of a workload whose answers grow, under each static placement and under
re-planning with in-job moves, from the same start.

    python benchmarks/drifting_placement.py --out-dir /tmp/drifting
    python benchmarks/drifting_placement.py --runs flattening replan \
        --set generation.stop_at_eos=false --set generation.max_new_tokens=4   # fixed lengths

The workload is examples/drifting/drifting_lengths.yaml: GRPO from the arithmetic SFT policy
(answers of a few tokens), rewarded by length alone, so the answers grow to
``generation.max_new_tokens`` while it trains. The start is one SFT run
(examples/sft_arithmetic.yaml, 1 rank, ``--sft`` reuses a finished one); the planner's profile is
measured first by ``tools/calibrate.py --ranks N`` (``--profile`` reuses one). Then each of
``--runs`` starts fresh from that checkpoint under torchrun (N gloo ranks, one thread each):

- ``flattening``, ``separation``, ``separation-async``: the static placements;
- ``replan``: flattening with ``placement.replan`` (``--interval`` steps, one warm-up step) and
  ``move=true``, so the run moves when the planner predicts another placement pays.

Prints one JSON line: per run the wall seconds of the whole job (start-up included), of its
steps and of its first step (the first calls of each model), the mean seconds per step and the
answers' mean length over each ``--block`` steps (step 0 left out), and for ``replan`` the moves
(step, target, measured seconds and their parts from ``plan_history.jsonl``) and every
re-planning's best candidate and predicted against measured step seconds, before and after the
calibration.

A flattening run that is synchronous moves only to synchronous placements: the engine moves an
asynchronous run only between separated placements, so ``separation-async`` is a static
reference that ``replan`` cannot reach.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from whole_runs import (  # noqa: E402
    PLACEMENT_RUNS,
    REPO,
    execute,
    metrics_records,
    torchrun,
)

CONFIG = REPO / "examples" / "drifting" / "drifting_lengths.yaml"
RUNS = {
    **PLACEMENT_RUNS,
    "replan": ["placement.strategy=flattening", "placement.replan.move=true"],
}


def train_start(out: Path) -> Path:
    """Train the workload's start (examples/sft_arithmetic.yaml, 1 rank) into ``out/sft``."""
    sft = out / "sft"
    execute(torchrun("train_sft.py", 1, "--config", str(REPO / "examples" / "sft_arithmetic.yaml"),
                     f"out_dir={sft}"), out / "sft.log", pythonpath=(CONFIG.parent,))
    return sft


def start_overrides(sft: Path) -> list[str]:
    """The overrides that start the workload from the SFT run ``sft``."""
    return [f"models.actor_checkpoint={sft / 'checkpoint'}",
            f"tokenizer.model_path={sft / 'tokenizer.model'}"]


def phase(steps: list[dict]) -> dict:
    """Mean seconds per step and answer length over ``steps``."""
    return {"steps": [steps[0]["step"], steps[-1]["step"]],
            "s_per_step": round(sum(r["step_seconds"] for r in steps) / len(steps), 4),
            "response_length": round(sum(r["response_length"] for r in steps) / len(steps), 1)}


def history(run_dir: Path) -> dict:
    """The moves and the re-plannings of a run's ``plan_history.jsonl``."""
    path = run_dir / "plan_history.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    moves = [{"after_step": line["step"], "to": line["moved"]["to"],
              **{key: round(line["moved"][key], 3) for key in
                 ("move_seconds", "save_s", "teardown_s", "build_s", "load_s")}}
             for line in lines if "moved" in line]
    plans = [{"after_step": line["step"], "current": line["current"], "best": line["best"],
              "gain": round(line["predicted_gain"], 3),
              "response_length": line["response_length_mean"],
              "move": line.get("move"),
              **{key: round(value, 4) for key, value in
                 line["predicted_vs_measured"]["step"].items()}}
             for line in lines if "moved" not in line]
    return {"moves": moves, "replans": plans}


def summarise(run_dir: Path, wall: float, block: int) -> dict:
    rows = [r for r in metrics_records(run_dir) if "step_seconds" in r]
    summary = {"wall_s": round(wall, 2),
               "steps_s": round(sum(r["step_seconds"] for r in rows), 2),
               "step0_s": round(rows[0]["step_seconds"], 2),
               "blocks": [phase(rows[max(1, i):i + block]) for i in range(0, len(rows), block)]}
    moved = [r["replan/move_seconds"] for r in rows if "replan/move_seconds" in r]
    if moved:
        summary["replan/move_seconds"] = [round(s, 3) for s in moved]
    return summary | (history(run_dir) if (run_dir / "plan_history.jsonl").exists() else {})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/drifting_placement"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=5, help="steps per re-planning")
    parser.add_argument("--block", type=int, default=10, help="steps per reported mean")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    parser.add_argument("--sft", type=Path, help="a finished SFT out_dir to start from")
    parser.add_argument("--profile", type=Path, help="a tools/calibrate.py profile to use")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="an override of every run (repeatable)")
    args = parser.parse_args(argv)
    out = args.out_dir.absolute()
    out.mkdir(parents=True, exist_ok=True)
    sft = args.sft.absolute() if args.sft else train_start(out)
    profile = args.profile.absolute() if args.profile else out / "profile.json"
    if not args.profile:
        done = subprocess.run([sys.executable, str(REPO / "tools" / "calibrate.py"), "--name",
                               "local", "--ranks", str(args.ranks), "--out", str(profile)],
                              cwd=REPO, capture_output=True, text=True, check=True)
        (out / "calibrate.log").write_text(done.stdout + done.stderr)
    start = [*start_overrides(sft), f"steps={args.steps}",
             "runtime.log_level=WARNING",
             f"placement.replan.profile={profile}", *args.overrides]
    results = {}
    for name in args.runs:
        run_dir = out / name
        overrides = [*start, f"run_dir={run_dir}", *RUNS[name]]
        if name == "replan":
            overrides += [f"placement.replan.interval_steps={args.interval}",
                          "placement.replan.warmup_steps=1"]
        wall = execute(torchrun("run_ppo.py", args.ranks, "--config", str(CONFIG), *overrides),
                       out / f"{name}.log", pythonpath=(CONFIG.parent,))
        results[name] = summarise(run_dir, wall, args.block)
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "interval": args.interval,
                      "overrides": args.overrides, "profile": str(profile), "runs": results}))


if __name__ == "__main__":
    main()
