"""Pairwise (Bradley-Terry) training of the scalar-head reward model on prompt/chosen/rejected.

CPU, the tiny model on the synthetic task, 2 gloo ranks, from the SFT run's trunk
(``examples/rm_tiny.yaml`` reads ``runs/sft_tiny/checkpoint``: run tools/train_sft.py first)::

    torchrun --nproc-per-node 2 tools/train_reward_model.py
    torchrun --nproc-per-node 2 tools/train_reward_model.py --init-from none --steps 60

Your own JSONL/Parquet file in the rm-static schema (see docs/quickstart.md)::

    torchrun --nproc-per-node 2 tools/train_reward_model.py --data data/prefs.jsonl \\
        --init-from runs/sft_tiny/checkpoint data.eval_paths=[data/prefs_test.jsonl]

GPU cluster (2 nodes of 8 GPUs), Llama-7B at TP=4, PP=2, bf16, from an SFT checkpoint::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        tools/train_reward_model.py --data data/prefs.jsonl --tp 4 --pp 2 \\
        --init-from runs/sft_7b/checkpoint model.arch=llama-7b model.params_dtype=bfloat16 \\
        tokenizer.model_path=runs/sft_7b/tokenizer.model train.max_length=1024

Reports pairwise accuracy on held-out pairs and writes ``metrics.jsonl``, ``config.yaml``,
``tokenizer.model`` and ``checkpoint/`` into the output directory. Any config field can be
overridden as ``section.key=value`` after the flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.data import DataError
from megatron_rlhf.engine.reward_training import RMConfig, run_reward_training
from megatron_rlhf.runtime.distributed import destroy_distributed

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "examples" / "rm_tiny.yaml")
PROG = "train_reward_model"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run configuration")
    parser.add_argument("--data", action="append", metavar="FILE",
                        help="a JSONL/Parquet file, repeatable (default: the synthetic task)")
    parser.add_argument("--init-from", help="SFT checkpoint whose trunk starts the model, or none")
    parser.add_argument("--tp", type=int, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size")
    parser.add_argument("--steps", type=int, help="stop after this many optimizer steps")
    parser.add_argument("--seed", type=int, help="seed of every RNG and of the data order")
    parser.add_argument("--out-dir", help="run directory (must not hold a checkpoint)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    init = None if args.init_from is None else "''" if args.init_from == "none" else args.init_from
    flags = {"model.tp": args.tp, "model.pp": args.pp, "train.max_steps": args.steps,
             "runtime.seed": args.seed, "out_dir": args.out_dir,
             "model.init_checkpoint": init,
             "data.paths": f"[{','.join(args.data)}]" if args.data else None}
    overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
    return args, overrides + args.overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        config = load_config(RMConfig, args.config, overrides)
    except ValueError as error:
        print(f"{PROG}: bad configuration: {error}", file=sys.stderr)
        return 2
    try:
        result = run_reward_training(config)
    except DataError as error:
        print(f"{PROG}: bad data: {error}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    if os.environ.get("RANK", "0") == "0":
        last = result.history[-1]
        print(f"{PROG}: done; held-out pairwise accuracy {last['eval_accuracy']:.3f}, checkpoint "
              f"in {result.out_dir / 'checkpoint'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
