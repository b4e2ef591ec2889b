"""The whole InstructGPT pipeline on CPU: tokenizer -> SFT -> reward model -> PPO.

    torchrun --nproc-per-node 4 tools/run_pipeline.py                       # separation
    torchrun --nproc-per-node 4 tools/run_pipeline.py --placement interleaving
    torchrun --nproc-per-node 4 tools/run_pipeline.py --data my_prefs.jsonl --run-dir runs/mine

Writes ``<run-dir>/{data,sft,rm,ppo}``, a curves picture ``<run-dir>/curves.png`` (reward-model
score, true rule score and KL per PPO step) and prints a short report. Anything after the flags
is a ``section.key=value`` override of the PPO configuration (examples/ppo_pipeline.yaml).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.engine.pipeline import run_pipeline
from megatron_rlhf.runtime.distributed import destroy_distributed
from megatron_rlhf.topology.config import STRATEGIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--placement", choices=STRATEGIES, default="separation")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/pipeline"))
    parser.add_argument("--data", action="append", default=[], metavar="FILE",
                        help="preference JSONL/Parquet file (repeatable); default: synthetic")
    parser.add_argument("--ppo-steps", type=int, help="PPO steps (default: the config's)")
    parser.add_argument("--sft-steps", type=int, help="cap on SFT steps (default: its epochs)")
    parser.add_argument("--rm-steps", type=int, help="cap on reward-model steps")
    parser.add_argument("overrides", nargs="*", help="PPO section.key=value overrides")
    return parser.parse_args(argv)


def report(result) -> str:
    """The closing summary: each step's last metrics and where to look."""
    sft, rm, ppo = (result.final[k] for k in ("sft", "rm", "ppo"))
    lines = [
        f"run directory: {result.run_dir.resolve()}",
        f"SFT: step {sft.get('step')}, held-out loss {sft.get('eval_loss', float('nan')):.3f}",
        f"reward model: step {rm.get('step')}, held-out pairwise accuracy "
        f"{rm.get('eval_accuracy', float('nan')):.3f}",
        f"PPO: step {ppo.get('step')}, reward-model score {ppo.get('rm_score', float('nan')):.3f}, "
        f"rule score {ppo.get('rule_score', float('nan')):.3f}, KL {ppo.get('kl', float('nan')):.3f}",
        f"curves: {result.run_dir / 'curves.png'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = [f"placement.strategy={args.placement}", *args.overrides]
    if args.ppo_steps is not None:
        overrides.append(f"steps={args.ppo_steps}")
    sft = [f"train.max_steps={args.sft_steps}"] if args.sft_steps else []
    rm = [f"train.max_steps={args.rm_steps}"] if args.rm_steps else []
    try:
        result = run_pipeline(args.run_dir, args.data, overrides, sft, rm)
    except (ConfigError, ValueError) as error:
        print(f"run_pipeline: {error}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    if os.environ.get("RANK", "0") == "0":
        from plot_curves import plot, read_metrics

        plot({"ppo": read_metrics(result.run_dir / "ppo")},
             ["rm_score", "rule_score", "kl"], result.run_dir / "curves.png", window=5)
        print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
