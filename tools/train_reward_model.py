"""Pairwise (Bradley-Terry) training of the scalar-head reward model on prompt/chosen/rejected.

CPU, the tiny model on the synthetic task, 2 gloo ranks, from the SFT run's trunk
(``examples/rm_tiny.yaml`` reads the repository's ``runs/sft_tiny/checkpoint``: run
tools/train_sft.py from the repository root first)::

    torchrun --nproc-per-node 2 tools/train_reward_model.py
    torchrun --nproc-per-node 2 tools/train_reward_model.py --init-from none --steps 60

Your own JSONL/Parquet file in the rm-static schema (see docs/howto/bring-data.md)::

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

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervised_cli import overrides_from, parser_for, run

from megatron_rlhf.runtime.patches import add_warning_filters

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "examples" / "rm_tiny.yaml")
PROG = "train_reward_model"


def _objective() -> tuple[type, Callable[[Any], Any]]:
    """The configuration and the training function, imported after rank 0 checked the
    configuration (tools/supervised_cli.py): they import megatron-core."""
    from megatron_rlhf.config.supervised_run import RMConfig
    from megatron_rlhf.supervised.reward_model import run_reward_training

    return RMConfig, run_reward_training


def main(argv: list[str] | None = None) -> int:
    parser = parser_for(PROG, __doc__, DEFAULT_CONFIG)
    parser.add_argument("--init-from", help="SFT checkpoint whose trunk starts the model, or none")
    args = parser.parse_args(argv)
    init = None if args.init_from is None else "''" if args.init_from == "none" else args.init_from
    overrides = overrides_from(args, {"model.init_checkpoint": init})
    return run(PROG, _objective, args.config, overrides,
               lambda result: ("held-out pairwise accuracy "
                            f"{result.history[-1]['eval_accuracy']:.3f}"))


if __name__ == "__main__":
    sys.exit(main())
