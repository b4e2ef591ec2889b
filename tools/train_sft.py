"""Supervised fine-tuning of the actor on prompt/response pairs (loss on the response tokens).

CPU, the tiny model on the synthetic task, 2 gloo ranks (DP=2)::

    torchrun --nproc-per-node 2 tools/train_sft.py
    torchrun --nproc-per-node 2 tools/train_sft.py --tp 2 --steps 50 --out-dir runs/sft_tp2
    torchrun --nproc-per-node 2 tools/train_sft.py --out-dir runs/sft_moe \\
        model.moe.num_experts=4 model.ep=2    # 4 experts (top-2) a layer, 2 on each rank

Your own JSONL/Parquet file in the rm-static schema (see docs/howto/bring-data.md)::

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

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervised_cli import overrides_from, parser_for, run

from megatron_rlhf.runtime.patches import add_warning_filters

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "examples" / "sft_tiny.yaml")
PROG = "train_sft"


def _objective() -> tuple[type, Callable[[Any], Any]]:
    """The configuration and the training function, imported after rank 0 checked the
    configuration (tools/supervised_cli.py): they import megatron-core."""
    from megatron_rlhf.config.supervised_run import SFTConfig
    from megatron_rlhf.supervised.sft import run_sft

    return SFTConfig, run_sft


def main(argv: list[str] | None = None) -> int:
    parser = parser_for(PROG, __doc__, DEFAULT_CONFIG)
    args = parser.parse_args(argv)
    overrides = overrides_from(args)
    return run(PROG, _objective, args.config, overrides,
               lambda result: f"eval_loss {result.history[-1]['eval_loss']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
