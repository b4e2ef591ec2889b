"""Supervised fine-tuning of the actor on prompt/response pairs (loss on the response tokens).

CPU, the tiny model on the synthetic task, 2 gloo ranks (DP=2)::

    torchrun --nproc-per-node 2 tools/train_sft.py
    torchrun --nproc-per-node 2 tools/train_sft.py --tp 2 --steps 50 --out-dir runs/sft_tp2

Your own JSONL/Parquet file in the rm-static schema (see docs/quickstart.md)::

    torchrun --nproc-per-node 2 tools/train_sft.py --data data/qa.jsonl \\
        data.reader.fields.prompt=question data.reader.fields.response=answer

GPU cluster (2 nodes of 8 GPUs), Llama-7B at TP=4, PP=2, bf16::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        tools/train_sft.py --data data/train.jsonl --tp 4 --pp 2 model.arch=llama-7b \\
        model.params_dtype=bfloat16 model.init_checkpoint=ckpt/llama7b \\
        tokenizer.model_path=ckpt/llama7b.model train.max_length=1024

Writes ``metrics.jsonl``, ``config.yaml``, ``tokenizer.model`` and ``checkpoint/`` (megatron
dist format, loadable at any TP/PP) into the output directory. Any config field can be overridden
as ``section.key=value`` after the flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.data import DataError
from megatron_rlhf.engine.sft import SFTConfig, run_sft
from megatron_rlhf.runtime.distributed import destroy_distributed

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "examples" / "sft_tiny.yaml")
PROG = "train_sft"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run configuration")
    parser.add_argument("--data", action="append", metavar="FILE",
                        help="a JSONL/Parquet file, repeatable (default: the synthetic task)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size")
    parser.add_argument("--steps", type=int, help="stop after this many optimizer steps")
    parser.add_argument("--seed", type=int, help="seed of every RNG and of the data order")
    parser.add_argument("--out-dir", help="run directory (must not hold a checkpoint)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    flags = {"model.tp": args.tp, "model.pp": args.pp, "train.max_steps": args.steps,
             "runtime.seed": args.seed, "out_dir": args.out_dir,
             "data.paths": f"[{','.join(args.data)}]" if args.data else None}
    overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
    return args, overrides + args.overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        config = load_config(SFTConfig, args.config, overrides)
    except ValueError as error:
        print(f"{PROG}: bad configuration: {error}", file=sys.stderr)
        return 2
    try:
        result = run_sft(config)
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
        print(f"{PROG}: done; eval_loss {last['eval_loss']:.4f}, checkpoint in "
              f"{result.out_dir / 'checkpoint'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
