"""Regret of ``--placement auto`` with re-planning: a suite of short workloads, each under every
static placement that applies and under ``auto`` with ``placement.replan`` moves, from the same
start.

    python benchmarks/regret.py --out-dir /tmp/regret
    python benchmarks/regret.py --workloads ppo-critic-4-long --repeats 1
    python benchmarks/regret.py --dry-run        # the command lines, nothing runs

The suite (``WORKLOADS``):

- ``drifting-grpo-2``: examples/drifting/drifting_lengths.yaml on 2 ranks (GRPO, answers that
  grow from ~4 to ~80 tokens from step 25), from the arithmetic SFT policy (``--sft`` reuses a
  finished one, else it is trained first);
- ``ppo-critic-4-short`` and ``ppo-critic-4-long``: examples/ppo_tiny.yaml (PPO with a critic) on
  4 ranks, answers forced to 12 and 96 tokens (``generation.stop_at_eos=false``);
- ``long-tail-grpo-4`` (not in the default suite): examples/long_tail/long_tail.yaml.

A workload with ``moving_from`` also runs ``moves-from-<placement>``: the auto run's re-planning
and moves, started at that static placement instead of the planner's choice (on 4 ranks
flattening, about twice the best placement's step), so that it has to move; it is reported
against the static run of the placement it started from.

Each workload runs its static placements (``flattening``, ``interleaving``, ``interleaving2``
where there is a critic, synchronous ``separation``) and ``auto``: ``--placement auto`` with
``placement.replan.interval_steps`` (the workload's), ``warmup_steps=1``, ``move=true`` and
``trial_margin=0.1`` (a trial of a runner-up predicted within 10%, where the run is long
enough); the profile is the planner's cached CPU profile unless ``--profile`` names one.
Asynchronous separation is left out: it trains on answers of the step before, so it learns
something else (on the drifting workload its answers grow ~15 steps later), and a synchronous
run cannot move to it. ``--repeats`` rounds run the workload's runs in turn, the order
reversed every other round, so that the machine's drift falls on every run alike; and each
regret is taken within a round (auto against the best static run of the same round, run next
to it) and reported per round with its median, which one disturbed round does not move.

A run's seconds per step are its steps after the first (the first calls of each model) plus its
moves' seconds (``replan/move_seconds``, not in ``step_seconds``), over those steps. Per
workload: each run's mean over the rounds, the best static, auto's first placement (from the
run's log) and its moves (``plan_history.jsonl``), auto's regret (``auto / best static - 1``)
and auto against the static run of the placement it started from, each from the means and per
round with the rounds' median; the same from whole-job wall seconds (start-up and re-planning
included); for ``moves-from-<placement>`` its moves and the same figures; and the noise: the
largest spread of one run's seconds per step between rounds (``max / min - 1``), against which
a regret from the means under it is not resolved. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drifting_placement import history, start_overrides, train_start  # noqa: E402
from whole_runs import PLACEMENT_RUNS, REPO, execute, metrics_records, torchrun  # noqa: E402

STATIC_RUNS = {
    "flattening": PLACEMENT_RUNS["flattening"],
    "interleaving": ["placement.strategy=interleaving"],
    "interleaving2": ["placement.strategy=interleaving2"],
    "separation": PLACEMENT_RUNS["separation"],
}
"""The static placements a workload may run, as overrides (all synchronous)."""
AUTO = "auto"
MOVING = "moves-from-"
FORCED = ("generation.stop_at_eos=false",)
TRIAL_MARGIN = 0.1


@dataclass(frozen=True)
class Workload:
    """One workload of the suite.

    Attributes:
        config: its YAML, relative to the repository.
        ranks: torchrun's ranks.
        steps: steps of each run.
        interval: ``placement.replan.interval_steps`` of the auto run.
        statics: the static placements that apply.
        overrides: overrides of every run.
        sft: starts from the arithmetic SFT policy, with the config's folder on PYTHONPATH (its
            user reward module).
        default: in the suite when ``--workloads`` is not given.
        moving_from: a static placement (one of ``statics``) that a further run,
            ``moves-from-<placement>``, starts at with auto's re-planning and moves.
    """

    config: str
    ranks: int
    steps: int
    interval: int
    statics: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    sft: bool = False
    default: bool = True
    moving_from: str | None = None
    notes: str = field(default="", compare=False)


WORKLOADS = {
    "drifting-grpo-2": Workload(
        "examples/drifting/drifting_lengths.yaml", ranks=2, steps=40, interval=5,
        statics=("flattening", "interleaving", "separation"), sft=True,
        notes="GRPO, answers grow from ~4 to ~80 tokens from step 25"),
    "ppo-critic-4-short": Workload(
        "examples/ppo_tiny.yaml", ranks=4, steps=12, interval=3,
        statics=("flattening", "interleaving", "interleaving2", "separation"),
        overrides=(*FORCED, "generation.max_new_tokens=12"),
        notes="PPO with a critic, answers forced to 12 tokens"),
    "ppo-critic-4-long": Workload(
        "examples/ppo_tiny.yaml", ranks=4, steps=12, interval=3,
        statics=("flattening", "interleaving", "interleaving2", "separation"),
        overrides=(*FORCED, "generation.max_new_tokens=96"), moving_from="flattening",
        notes="PPO with a critic, answers forced to 96 tokens"),
    "long-tail-grpo-4": Workload(
        "examples/long_tail/long_tail.yaml", ranks=4, steps=12, interval=3,
        statics=("flattening", "interleaving", "separation"), default=False,
        notes="GRPO, geometric answer lengths up to 128 tokens"),
}


def run_names(workload: Workload) -> list[str]:
    """The runs of ``workload``: its static placements, auto, then the moving run if any."""
    moving = [MOVING + workload.moving_from] if workload.moving_from else []
    return [*workload.statics, AUTO, *moving]


def round_order(workload: Workload, round_index: int) -> list[str]:
    """The order of the runs in round ``round_index``: reversed every other round."""
    names = run_names(workload)
    return names if round_index % 2 == 0 else names[::-1]


def run_overrides(workload: Workload, name: str, run_dir: Path, start: list[str],
                  profile: Path | None = None) -> list[str]:
    """The arguments after the config of run ``name`` of ``workload``."""
    common = [*start, f"steps={workload.steps}", f"run_dir={run_dir}",
              "runtime.log_level=WARNING", *workload.overrides]
    replan = [f"placement.replan.interval_steps={workload.interval}",
              "placement.replan.warmup_steps=1", "placement.replan.move=true",
              f"placement.replan.trial_margin={TRIAL_MARGIN}",
              *([f"placement.replan.profile={profile}"] if profile else [])]
    if name.startswith(MOVING):
        return [*common, *STATIC_RUNS[name.removeprefix(MOVING)], *replan]
    if name != AUTO:
        return [*common, *STATIC_RUNS[name]]
    return ["--placement", "auto", *(["--profile", str(profile)] if profile else []), *common,
            *replan]


def run_command(workload: Workload, name: str, run_dir: Path, start: list[str],
                profile: Path | None = None) -> list[str]:
    """The torchrun command line of run ``name`` of ``workload``."""
    return torchrun("run_ppo.py", workload.ranks, "--config", str(REPO / workload.config),
                    *run_overrides(workload, name, run_dir, start, profile))


AUTO_LINE = re.compile(r"placement auto -> \S+: (.+?) wins")


def auto_choice(log: str) -> str | None:
    """The label of the placement ``--placement auto`` chose, from the run's log."""
    found = AUTO_LINE.search(log)
    return found.group(1) if found else None


def static_of(label: str | None) -> str | None:
    """The static run whose placement is the planner's ``label``, None where none is (another
    TP/PP, a custom ratio vector, another separation split)."""
    if not label or "tp=1 pp=1" not in label:
        return None
    head = label.split()[0]
    if head in ("flattening", "interleaving", "interleaving2"):
        return head
    split = re.match(r"separation\((\d+)/(\d+) train\) ", label)
    if split and 2 * int(split.group(1)) == int(split.group(2)) and "shadow_tp=1" in label:
        return "separation"
    return None


def step_seconds(records: list[dict]) -> dict:
    """Seconds per step of a run's ``metrics.jsonl`` records: the steps after the first, plus
    the seconds of the moves (recorded in the step after each), over those steps."""
    steps = [r for r in records if "step_seconds" in r][1:]
    moves = [r["replan/move_seconds"] for r in steps if "replan/move_seconds" in r]
    total = sum(r["step_seconds"] for r in steps) + sum(moves)
    return {"s_per_step": round(total / len(steps), 4), "steps_measured": len(steps),
            "move_s": round(sum(moves), 3),
            "response_length": round(sum(r["response_length"] for r in steps) / len(steps), 1)}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b - 1``, rounded, None where either is missing."""
    return None if a is None or b is None else round(a / b - 1, 4)


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4)


def median(values: list[float | None]) -> float | None:
    """The median of the values given (None: none given)."""
    given = sorted(v for v in values if v is not None)
    if not given:
        return None
    middle = len(given) // 2
    return given[middle] if len(given) % 2 else round((given[middle - 1] + given[middle]) / 2, 4)


def paired(rounds: list[dict[str, dict]], name: str, statics: tuple[str, ...]) -> dict:
    """Run ``name`` against the best of ``statics`` within each round (``name / best - 1``)
    and the rounds' median."""
    by_round = [ratio(r[name]["s_per_step"], min(r[s]["s_per_step"] for s in statics))
                for r in rounds]
    return {"by_round": by_round, "median": median(by_round)}


def workload_figures(workload: Workload, rounds: list[dict[str, dict]]) -> dict:
    """Regret figures of ``workload`` from its rounds (per round, run name -> run summary with
    ``s_per_step`` and ``wall_s``; the auto run's with ``initial`` and ``moves``)."""
    runs = {name: {"s_per_step": mean([r[name]["s_per_step"] for r in rounds]),
                   "wall_s": mean([r[name]["wall_s"] for r in rounds]),
                   "rounds_s_per_step": [r[name]["s_per_step"] for r in rounds]}
            for name in run_names(workload)}
    for run in runs.values():
        run["spread"] = ratio(max(run["rounds_s_per_step"]), min(run["rounds_s_per_step"]))
    best = min(workload.statics, key=lambda name: runs[name]["s_per_step"])
    best_wall = min(workload.statics, key=lambda name: runs[name]["wall_s"])
    initial = [r[AUTO].get("initial") for r in rounds]
    start = static_of(initial[0])
    auto = runs[AUTO]
    regret = paired(rounds, AUTO, workload.statics)
    vs_start = paired(rounds, AUTO, (start,)) if start else None
    figures = {
        "runs": runs, "best_static": best, "auto_initial": initial,
        "auto_start_static": start,
        "auto_moves": [r[AUTO].get("moves", []) for r in rounds],
        "regret": ratio(auto["s_per_step"], runs[best]["s_per_step"]),
        "regret_by_round": regret["by_round"], "regret_median": regret["median"],
        "vs_start": ratio(auto["s_per_step"], runs[start]["s_per_step"]) if start else None,
        "vs_start_by_round": vs_start["by_round"] if vs_start else None,
        "vs_start_median": vs_start["median"] if vs_start else None,
        "best_static_wall": best_wall,
        "regret_wall": ratio(auto["wall_s"], runs[best_wall]["wall_s"]),
        "vs_start_wall": ratio(auto["wall_s"], runs[start]["wall_s"]) if start else None,
        "noise": max(run["spread"] for run in runs.values()),
        "within_5pct": regret["median"] <= 0.05,
        "not_worse_than_start": None if vs_start is None else vs_start["median"] <= 0,
    }
    if workload.moving_from:
        figures["moving"] = moving_figures(workload, rounds, runs)
    return figures


def moving_figures(workload: Workload, rounds: list[dict[str, dict]], runs: dict) -> dict:
    """The figures of ``moves-from-<placement>``: its moves, its regret against the best static
    run and against the static run of the placement it started from, within each round."""
    name, start = MOVING + workload.moving_from, workload.moving_from
    regret, vs_start = paired(rounds, name, workload.statics), paired(rounds, name, (start,))
    return {"from": start, "moves": [r[name].get("moves", []) for r in rounds],
            "regret_by_round": regret["by_round"], "regret_median": regret["median"],
            "vs_start_by_round": vs_start["by_round"], "vs_start_median": vs_start["median"],
            "vs_start_wall": ratio(runs[name]["wall_s"], runs[start]["wall_s"]),
            "not_worse_than_start": vs_start["median"] <= 0}


def summarise(run_dir: Path, wall: float, log: Path, name: str) -> dict:
    """One run's figures: seconds per step (``step_seconds``), wall, auto's first placement,
    and the moves of auto and of the moving run."""
    summary = {"wall_s": round(wall, 2), **step_seconds(metrics_records(run_dir))}
    if name == AUTO:
        summary["initial"] = auto_choice(log.read_text())
    if name == AUTO or name.startswith(MOVING):
        summary["moves"] = history(run_dir)["moves"]
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/regret"))
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=[name for name, w in WORKLOADS.items() if w.default])
    parser.add_argument("--repeats", type=int, default=2, help="rounds of each workload")
    parser.add_argument("--sft", type=Path, help="a finished arithmetic SFT out_dir")
    parser.add_argument("--profile", type=Path,
                        help="a tools/calibrate.py profile (default: the cached CPU profile)")
    parser.add_argument("--steps", type=int, help="steps of every run (a quick check)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = parser.parse_args(argv)
    out = args.out_dir.absolute()
    profile = args.profile.absolute() if args.profile else None
    sft = args.sft.absolute() if args.sft else out / "sft"
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        if not args.sft and any(WORKLOADS[name].sft for name in args.workloads):
            sft = train_start(out)
    figures, commands = {}, []
    for name in args.workloads:
        workload = WORKLOADS[name]
        if args.steps:
            workload = dataclasses.replace(workload, steps=args.steps)
        start = start_overrides(sft) if workload.sft else []
        pythonpath = (REPO / Path(workload.config).parent,) if workload.sft else ()
        rounds = []
        for index in range(args.repeats):
            results = {}
            for run in round_order(workload, index):
                run_dir = out / name / f"{run}-{index}"
                argv_run = run_command(workload, run, run_dir, start, profile)
                if args.dry_run:
                    commands.append(" ".join(argv_run))
                    continue
                log = out / name / f"{run}-{index}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                wall = execute(argv_run, log, pythonpath=pythonpath)
                results[run] = summarise(run_dir, wall, log, run)
            rounds.append(results)
        if not args.dry_run:
            figures[name] = workload_figures(workload, rounds)
    line = {"benchmark": "regret", "repeats": args.repeats, "steps": args.steps,
            "profile": str(profile) if profile else "cached CPU profile",
            "workloads": figures,
            "regret_median": {name: f["regret_median"] for name, f in figures.items()},
            "vs_start_median": {name: f["vs_start_median"] for name, f in figures.items()},
            "moving_vs_start_median": {name: f["moving"]["vs_start_median"]
                                       for name, f in figures.items() if "moving" in f}}
    if args.dry_run:
        line["commands"] = commands
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
