"""Answers with long-tailed lengths on 4 CPU ranks: synchronous flattening against one-step-off
(asynchronous) separation, by samples/s, the generating ranks' idle time and staleness.

    python benchmarks/long_tail.py --out-dir /tmp/long_tail
    python benchmarks/long_tail.py --runs flattening separation-async --steps 6

The workload is examples/long_tail/long_tail.yaml: GRPO on the tiny model, answers that end at
any of 16 stop tokens, so their lengths are about geometric (mean ~35 tokens, the longest of a
step ~120 of 128). Each of ``--runs`` starts fresh under torchrun (``--ranks`` gloo ranks, one
thread each) with tracing on:

- ``flattening``: every model on every rank, synchronous;
- ``separation``: the shadow actor on half of the ranks, synchronous;
- ``separation-async``: the same, one step off (``rollout.async_rollout``);
- ``separation-async-decoupled``: one step off with ``algorithm.off_policy=decoupled`` (one
  forward pass of the actor more per step);
- ``separation-async-reuse``: one step off with the old log-probs taken from generation
  (``rollout.reuse_generation_logprobs``), which partial rollouts need;
- ``separation-async-partial``: that with ``rollout.partial_rollouts``: the shadows take the
  trained weights mid-round;
- ``separation-async-continued``: that with ``rollout.continue_answers`` (``max_staleness=3``):
  answers go on across steps and each step trains the first 8 groups that finish.

Prints one JSON line: per run the samples/s over the steps after the first (the first calls of
each model), the mean and longest answer, the idle fraction of the ranks that generate and of
the others over those steps (1 - time in compute stages / wall time, from ``timeline.json``;
waiting in transfers and weight sync counts as idle), and the mean staleness of the trained
tokens (``rollout/staleness_mean``), the fraction of answers that span a weight update
(``rollout/partial_fraction``) and the off-policy metrics where there are some.
"""

from __future__ import annotations

import argparse
import json
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

CONFIG = REPO / "examples" / "long_tail" / "long_tail.yaml"
RUNS = {
    **PLACEMENT_RUNS,
    "separation-async-decoupled": ["placement.strategy=separation", "rollout.async_rollout=true",
                                   "algorithm.off_policy=decoupled"],
    "separation-async-reuse": ["placement.strategy=separation", "rollout.async_rollout=true",
                               "rollout.reuse_generation_logprobs=true"],
    "separation-async-partial": ["placement.strategy=separation", "rollout.async_rollout=true",
                                 "rollout.reuse_generation_logprobs=true",
                                 "rollout.partial_rollouts=true"],
    "separation-async-continued": ["placement.strategy=separation", "rollout.async_rollout=true",
                                   "rollout.reuse_generation_logprobs=true",
                                   "rollout.partial_rollouts=true", "rollout.max_staleness=3",
                                   "rollout.continue_answers=true"],
}
COMPUTE_STAGES = {"generate", "experience", "advantages", "train"}
"""As benchmarks/placements.py: the stages that compute; the rest is waiting."""


def busy_seconds(spans: list[tuple[float, float]], begin: float, end: float) -> float:
    """Seconds of ``[begin, end]`` covered by at least one ``(start, end)`` span."""
    busy, cursor = 0.0, begin
    for start, stop in sorted(spans):
        start, stop = max(start, cursor), min(stop, end)
        if stop > start:
            busy += stop - start
            cursor = stop
    return busy


def idle_fractions(events: list[dict]) -> dict[str, float]:
    """Mean idle fraction of the generating ranks and of the others, after the first step.

    The window opens when rank 0 ends its first ``sync_weights`` span (the end of step 0) and
    closes at the last span of any rank; a rank generates when it has a ``generate`` span.
    """
    spans = [event for event in events if event.get("ph") == "X"]
    first_sync = min(event["ts"] + event["dur"] for event in spans
                     if event["pid"] == 0 and event["cat"] == "sync_weights")
    end = max(event["ts"] + event["dur"] for event in spans)
    ranks = sorted({event["pid"] for event in spans})
    generating = {event["pid"] for event in spans if event["cat"] == "generate"}
    idle = {}
    for rank in ranks:
        busy = busy_seconds([(e["ts"], e["ts"] + e["dur"]) for e in spans
                             if e["pid"] == rank and e["cat"] in COMPUTE_STAGES],
                            first_sync, end)
        idle[rank] = 1.0 - busy / (end - first_sync)
    groups = {"generating": [idle[r] for r in ranks if r in generating],
              "others": [idle[r] for r in ranks if r not in generating]}
    return {name: round(sum(values) / len(values), 3) for name, values in groups.items()
            if values}


def summarise(run_dir: Path, rows: int) -> dict:
    """What a run measured, after its first step."""
    steps = [r for r in metrics_records(run_dir) if "step_seconds" in r][1:]

    def mean(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return round(sum(values) / len(values), 4) if values else None

    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    summary = {
        "samples_per_s": round(rows * len(steps) / sum(r["step_seconds"] for r in steps), 3),
        "s_per_step": mean("step_seconds"),
        "response_length": mean("response_length"),
        "response_length_max": mean("response_length_max"),
        "idle_fraction": idle_fractions(events),
        "staleness_mean": mean("rollout/staleness_mean"),
        "partial_fraction": mean("rollout/partial_fraction"),
        "staleness_max": max((r["rollout/staleness_max"] for r in steps
                              if "rollout/staleness_max" in r), default=None),
        "dropped_stale": sum(r.get("rollout/dropped_stale", 0.0) for r in steps),
    }
    for key in ("off_policy/weight_mean", "off_policy/weight_max", "off_policy/logprob_gap"):
        if mean(key) is not None:
            summary[key] = mean(key)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/long_tail_benchmark"))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="an override of every run (repeatable)")
    args = parser.parse_args(argv)
    out = args.out_dir.absolute()
    out.mkdir(parents=True, exist_ok=True)
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    rows = load_config(RunConfig, CONFIG, args.overrides).rollout.rows_per_step
    results = {}
    for name in args.runs:
        run_dir = out / name
        argv_run = torchrun("run_ppo.py", args.ranks, "--config", str(CONFIG), *RUNS[name],
                            *args.overrides, f"steps={args.steps}", "trace=true",
                            f"run_dir={run_dir}")
        wall = execute(argv_run, out / f"{name}.log")
        results[name] = {"wall_s": round(wall, 2), **summarise(run_dir, rows)}
    print(json.dumps({"benchmark": "long_tail", "ranks": args.ranks, "steps": args.steps,
                      "rows_per_step": rows, "runs": results}))


if __name__ == "__main__":
    main()
