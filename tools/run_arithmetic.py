"""SFT then GRPO on a shipped arithmetic task, scored by an exact-answer verifier alone.

    torchrun --nproc-per-node 1 tools/run_arithmetic.py --seed 0 --run-dir runs/arithmetic/seed0
    torchrun --nproc-per-node 1 tools/run_arithmetic.py --seed 1 steps=60   # GRPO overrides
    PYTHONPATH=examples/calculator torchrun --nproc-per-node 1 tools/run_arithmetic.py \
        --task calculator --seed 0        # three-digit products, with a calculator tool

The tasks (``--task``): ``addition`` (the default, below), ``calculator`` (SFT on demonstrations
that call ``calculator_tools:calculator``, then GRPO whose episodes call it; the last reply is
scored by ``final_answer_reward``; examples/calculator/) and ``calculator-no-tools`` (the same
questions answered directly, SFT and GRPO without the tool).

SFT (examples/sft_arithmetic.yaml) learns from the 64 demonstrations of
examples/arithmetic/sft.jsonl; GRPO (examples/grpo_arithmetic.yaml) starts from it and is rewarded
only by ``math_reward`` against each prompt's ``answer``. The held-out questions of
examples/arithmetic/test.jsonl are answered before GRPO's first step (the SFT policy) and after
its last, as every run's evaluation does; the tool prints their exact-match accuracy
(``eval/<mode>/reward/math_reward``) and draws GRPO's curves into ``<run-dir>/curves.png``.
``--seed`` seeds both stages (data order, initialisation, sampling). Anything after the flags is
a ``section.key=value`` override of the GRPO configuration. ``--compare`` runs nothing: it draws
finished runs (one per seed) into one picture, as docs/images/arithmetic_grpo.png::

    python tools/run_arithmetic.py --compare runs/arithmetic/seed{0,1,2} --out seeds.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf import __version__
from megatron_rlhf.runtime.patches import add_warning_filters

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

# megatron-core and pyplot are imported where they are used, not here: the worker processes of
# the run's tools and reward functions (rollout.tool_workers, reward.workers) are spawned, and
# each imports this script again before it can take a call.
import torch.distributed as dist  # noqa: E402

from megatron_rlhf.config.loader import ConfigError, load_config  # noqa: E402
from megatron_rlhf.config.ppo_run import RunConfig  # noqa: E402
from megatron_rlhf.config.supervised_run import SFTConfig  # noqa: E402
from megatron_rlhf.rewards import UserCodeError  # noqa: E402
from megatron_rlhf.runtime.bootstrap import initialize_runtime  # noqa: E402
from megatron_rlhf.runtime.distributed import destroy_distributed  # noqa: E402
from megatron_rlhf.runtime.faults import NonFiniteError, RankFailure  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_sft(config: SFTConfig) -> None:
    """``megatron_rlhf.supervised.sft.run_sft``."""
    from megatron_rlhf.supervised.sft import run_sft as run

    run(config)


def run_ppo(config: RunConfig) -> Path:
    """``megatron_rlhf.engine.run.runner.run_ppo``."""
    from megatron_rlhf.engine.run.runner import run_ppo as run

    return run(config)


@dataclass(frozen=True)
class Task:
    """A task's two stages and its verifier.

    Attributes:
        sft: the SFT configuration.
        grpo: the GRPO configuration, starting from SFT's checkpoint and tokenizer.
        verifier: the reward function whose score is the exact-match accuracy.
        runs: the default run directory's parent.
    """

    sft: Path
    grpo: Path
    verifier: str
    runs: Path

    def accuracy(self, mode: str) -> str:
        """The held-out exact-match accuracy of ``mode`` answers in a run's metrics."""
        return f"eval/{mode}/reward/{self.verifier}"


CALCULATOR = EXAMPLES / "calculator"
TASKS = {
    "addition": Task(EXAMPLES / "sft_arithmetic.yaml", EXAMPLES / "grpo_arithmetic.yaml",
                     "math_reward", Path("runs/arithmetic")),
    "calculator": Task(CALCULATOR / "sft_tools.yaml", CALCULATOR / "grpo_tools.yaml",
                       "final_answer_reward", Path("runs/calculator/tools")),
    "calculator-no-tools": Task(CALCULATOR / "sft_direct.yaml", CALCULATOR / "grpo_direct.yaml",
                                "final_answer_reward", Path("runs/calculator/no-tools")),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--task", choices=sorted(TASKS), default="addition")
    parser.add_argument("--seed", type=int, default=0, help="seed of both stages")
    parser.add_argument("--run-dir", type=Path, help="default: runs/<task>/seed<seed>")
    parser.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override of the SFT configuration (repeatable)")
    parser.add_argument("--compare", nargs="+", type=Path, metavar="RUN_DIR",
                        help="draw these finished runs into --out instead of running")
    parser.add_argument("--out", type=Path, default=Path("arithmetic_seeds.png"))
    parser.add_argument("overrides", nargs="*", help="GRPO section.key=value overrides")
    return parser.parse_args(argv)


def configs(args: argparse.Namespace, run_dir: Path) -> tuple[SFTConfig, RunConfig]:
    """The two stages' configurations, GRPO starting from SFT's checkpoint and tokenizer."""
    from megatron_rlhf.supervised.loop import CHECKPOINT_DIR, TOKENIZER_FILE

    seed, task = args.seed, TASKS[args.task]
    sft = load_config(SFTConfig, task.sft, [
        f"out_dir={run_dir / 'sft'}", f"runtime.seed={seed}", f"model.init_seed={1000 + seed}",
        *args.sft_set])
    grpo = load_config(RunConfig, task.grpo, [
        f"run_dir={run_dir / 'grpo'}", f"runtime.seed={seed}", f"generation.seed={seed}",
        f"models.actor_checkpoint={run_dir / 'sft' / CHECKPOINT_DIR}",
        f"tokenizer.model_path={run_dir / 'sft' / TOKENIZER_FILE}", *args.overrides])
    return sft, grpo


def held_out_accuracy(records: list[dict], task: Task) -> dict[str, dict[str, float]]:
    """``{"sft": ..., "grpo": ...}``: each mode's held-out accuracy before GRPO's first step and
    after its last."""
    from megatron_rlhf.engine.run.evaluation import MODES

    evaluations = [r for r in records if task.accuracy(MODES[0]) in r]
    return {stage: {mode: record[task.accuracy(mode)] for mode in MODES}
            for stage, record in (("sft", evaluations[0]), ("grpo", evaluations[-1]))}


def grpo_records(run_dir: Path) -> list[dict]:
    """The GRPO stage's metrics records of a finished run."""
    return [json.loads(line) for line in
            (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare(run_dirs: list[Path], out: Path, task: Task) -> None:
    """One panel of training-batch accuracy and one of held-out accuracy per mode, a line per
    run (labelled by its directory and its parent's names)."""
    from plot_curves import plt, smooth  # its pyplot, on the Agg backend

    from megatron_rlhf.engine.run.evaluation import MODES

    runs = {f"{run_dir.parent.name}/{run_dir.name}": grpo_records(run_dir) for run_dir in run_dirs}
    keys = {"train batches": f"reward/{task.verifier}",
            **{f"held-out ({mode})": task.accuracy(mode) for mode in MODES}}
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for index, (label, records) in enumerate(runs.items()):
        for ax, key in zip(axes, keys.values(), strict=True):
            steps, values = zip(*[(r["step"], r[key]) for r in records if key in r], strict=True)
            if key.startswith("eval/"):
                ax.plot(steps, values, marker="o", color=f"C{index}", label=label)
                continue
            ax.plot(steps, values, color=f"C{index}", alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth(list(values), 5), color=f"C{index}", label=label)
    for ax, title in zip(axes, keys, strict=True):
        ax.set_title(f"{title}: exact-match accuracy", fontsize=10)
        ax.set_xlabel("GRPO step (step 0: the SFT policy)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def report(run_dir: Path, task: Task) -> str:
    """The held-out accuracies of the SFT and GRPO policies, and a picture of GRPO's curves."""
    from plot_curves import plot

    from megatron_rlhf.engine.run.evaluation import MODES

    records = grpo_records(run_dir)
    accuracy = held_out_accuracy(records, task)
    evaluations = {mode: [{"step": r["step"], "accuracy": r[task.accuracy(mode)]}
                          for r in records if task.accuracy(mode) in r] for mode in MODES}
    train = f"reward/{task.verifier}"
    plot({"train batches": [{"step": r["step"], "accuracy": r[train]}
                            for r in records if train in r],
          **{f"held-out ({mode})": rows for mode, rows in evaluations.items()}},
         ["accuracy"], run_dir / "curves.png", window=5,
         raw=frozenset(f"held-out ({mode})" for mode in MODES))
    lines = [f"held-out exact-match accuracy ({run_dir}):"]
    for mode in MODES:
        sft, grpo = accuracy["sft"][mode], accuracy["grpo"][mode]
        lines.append(f"  {mode:<8} SFT {sft:.3f} -> GRPO {grpo:.3f} ({grpo - sft:+.3f})")
    lines.append(f"curves: {run_dir / 'curves.png'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        compare(args.compare, args.out, TASKS[args.task])
        print(f"wrote {args.out}")
        return 0
    run_dir = args.run_dir or TASKS[args.task].runs / f"seed{args.seed}"
    try:
        sft, grpo = configs(args, run_dir)
    except (ConfigError, ValueError) as error:
        if os.environ.get("RANK", "0") == "0":  # every rank refuses alike: rank 0 says why
            print(f"run_arithmetic: {error}", file=sys.stderr)
        return 2
    initialize_runtime()
    try:
        run_sft(sft)
        run_ppo(grpo)
        if dist.get_rank() == 0:
            print(report(run_dir, TASKS[args.task]))
    except (RankFailure, NonFiniteError, UserCodeError) as error:
        # The message names the cause (the calculator tool or the answer reward: it, the record
        # and where it raised); a traceback per rank would bury it.
        print(f"run_arithmetic: rank {os.environ.get('RANK', '0')}: {error}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
