"""The whole InstructGPT pipeline on CPU: tokenizer -> SFT -> reward model -> PPO.

    torchrun --nproc-per-node 4 tools/run_pipeline.py                       # separation
    torchrun --nproc-per-node 4 tools/run_pipeline.py --placement interleaving
    torchrun --nproc-per-node 4 tools/run_pipeline.py --data my_prefs.jsonl --run-dir runs/mine

Writes ``<run-dir>/{data,sft,rm,untrained,ppo}``, a curves picture ``<run-dir>/curves.png``
(reward-model score, true rule score and KL per PPO step, on the training batches and on the
held-out prompts) and prints a report comparing the untrained, SFT and final PPO policies on the
held-out prompts. ``--seed`` seeds the synthetic task and every stage. Anything after the flags
is a ``section.key=value`` override of the PPO configuration (examples/ppo_pipeline.yaml).
Every stage's settings (``--sft-set``, ``--rm-set`` and the PPO overrides) are checked before
the first stage runs; a mistake is said once, by rank 0, naming its stage, and exits 2.

The console holds a set-up summary, each stage's progress bar, warnings and the report; the full
log is ``<run-dir>/log.txt``. ``--verbose`` puts every rank's log on the console instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_rlhf import __version__
from megatron_rlhf.runtime.patches import add_warning_filters

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.instructgpt import check_stage_configs, format_report, run_pipeline
from megatron_rlhf.rewards import UserCodeError
from megatron_rlhf.runtime.distributed import destroy_distributed
from megatron_rlhf.runtime.faults import NonFiniteError, RankFailure
from megatron_rlhf.runtime.logging import log_to_file
from megatron_rlhf.runtime.refusal import RankZeroFirst, refuse
from megatron_rlhf.topology.placement_config import STRATEGIES


def _directory(value: str) -> Path:
    """``--run-dir``: an empty value would put every stage's files into the working directory."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{value!r} names no directory")
    return Path(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--placement", choices=STRATEGIES, default="separation")
    parser.add_argument("--run-dir", type=_directory, default=Path("runs/pipeline"))
    parser.add_argument("--data", action="append", default=[], metavar="FILE",
                        help="preference JSONL/Parquet file (repeatable); default: synthetic")
    parser.add_argument("--ppo-steps", type=int, help="PPO steps (default: the config's)")
    parser.add_argument("--sft-steps", type=int, help="cap on SFT steps (default: its epochs)")
    parser.add_argument("--rm-steps", type=int, help="cap on reward-model steps")
    parser.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override of the SFT configuration (repeatable), e.g. train.epochs=6")
    parser.add_argument("--rm-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override of the reward-model configuration (repeatable)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the synthetic task and of every stage's runtime")
    parser.add_argument("--verbose", action="store_true",
                        help="every rank's log on the console (default: rank 0's, in "
                        "<run-dir>/log.txt, the console keeping warnings)")
    parser.add_argument("overrides", nargs="*", help="PPO section.key=value overrides")
    return parser.parse_args(argv)


def summary(args: argparse.Namespace) -> str:
    """What the run will do, in the console's first lines."""
    data = ", ".join(args.data) if args.data else "the synthetic task"
    log = "on the console" if args.verbose else str(args.run_dir / "log.txt")
    return (f"run_pipeline: {os.environ.get('WORLD_SIZE', '1')} ranks, placement "
            f"{args.placement}, seed {args.seed}\n"
            f"  stages: tokenizer, SFT, reward model, PPO; data: {data}\n"
            f"  run directory: {args.run_dir}; log: {log}")


def curves(records: list[dict]) -> dict[str, list[dict]]:
    """PPO's training metrics and its held-out evaluations as runs for ``plot_curves.plot``
    (every record has a rule score; a reward-model score only with a reward model)."""
    from megatron_rlhf.engine.run.evaluation import MODES  # megatron-core: after the stages

    runs = {"train batches": [r for r in records if "rule_score" in r]}
    for mode in MODES:
        prefix = f"eval/{mode}/"
        runs[f"held-out ({mode})"] = [
            {"step": r["step"], **{k[len(prefix):]: v for k, v in r.items()
                                   if k.startswith(prefix)}}
            for r in records if f"{prefix}rule_score" in r]
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = f"runtime.seed={args.seed}"
    overrides = [f"placement.strategy={args.placement}", seed,
                 f"prompts.synthetic.seed={args.seed}", *args.overrides]
    if args.ppo_steps is not None:
        overrides.append(f"steps={args.ppo_steps}")
    sft = [seed, *([f"train.max_steps={args.sft_steps}"] if args.sft_steps else []),
           *args.sft_set]
    rm = [seed, *([f"train.max_steps={args.rm_steps}"] if args.rm_steps else []), *args.rm_set]
    if args.verbose:
        for stage in (overrides, sft, rm):
            stage.insert(0, "runtime.log_all_ranks=true")
    else:
        log_to_file(args.run_dir / "log.txt")
    # Rank 0 checks every stage's configuration while the other ranks wait, megatron-core not
    # yet imported: a mistake is said in seconds, once, and not after the stages before it ran.
    first = RankZeroFirst("run_pipeline")
    if first.refused():
        return 2
    try:
        check_stage_configs(args.run_dir, args.data, overrides, sft, rm)
    except (ConfigError, ValueError) as error:
        return first.refuse(f"bad configuration: {error}")
    first.accept()
    if os.environ.get("RANK", "0") == "0":
        print(summary(args), file=sys.stderr)
    try:
        result = run_pipeline(args.run_dir, args.data, overrides, sft, rm)
    except (ConfigError, ValueError) as error:
        return refuse("run_pipeline", str(error))
    except (RankFailure, NonFiniteError, UserCodeError) as error:
        # The message names the cause (a reward function, tool or environment of the user's:
        # it, the record and where it raised); a traceback per rank would bury it.
        print(f"run_pipeline: rank {os.environ.get('RANK', '0')}: {error}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
    if os.environ.get("RANK", "0") == "0":
        from plot_curves import plot, read_metrics

        runs = curves(read_metrics(result.run_dir / "ppo"))
        plot(runs, ["rm_score", "rule_score", "kl"], result.run_dir / "curves.png", window=5,
             raw=frozenset(label for label in runs if label.startswith("held-out")))
        print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
