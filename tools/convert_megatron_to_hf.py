"""Export a megatron_rlhf model checkpoint as a Hugging Face checkpoint.

    # one process loads the whole model (any saved TP/PP), rank 0 writes the files
    python tools/convert_megatron_to_hf.py --ckpt ckpt/actor --out llama-out
    # a model too large for one process: load it split, e.g. TP=2 on two gloo ranks
    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py --ckpt ckpt/actor \
        --out llama-out --tp 2
    # on a GPU node the same command line uses NCCL, one GPU per rank

Writes ``config.json`` and ``model.safetensors`` (in the checkpoint's dtype) of the family that
computes the model (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral; the original's where it does) that
``AutoModelForCausalLM`` (``lm`` head) or ``AutoModelForSequenceClassification`` (``scalar`` head)
loads, and copies the tokenizer files of ``--tokenizer-dir`` (default: the HF directory the
checkpoint was converted from, when it still exists). When the checkpoint came from
tools/convert_hf_to_megatron.py, the original config.json's other fields (token ids, ...) are kept.
The full tensors are gathered on every rank, so each rank needs host memory for the whole model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch.distributed as dist  # noqa: E402

from megatron_rlhf import __version__
from megatron_rlhf.runtime.patches import add_warning_filters

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

from megatron_rlhf.models.checkpoint import (  # noqa: E402
    load_model_checkpoint,
    read_checkpoint_info,
)
from megatron_rlhf.models.gpt import build_gpt_model  # noqa: E402
from megatron_rlhf.models.hf_llama import (  # noqa: E402
    full_state_to_hf,
    save_hf_checkpoint,
)
from megatron_rlhf.models.weights import gather_full_state  # noqa: E402
from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime  # noqa: E402
from megatron_rlhf.runtime.distributed import destroy_distributed  # noqa: E402
from megatron_rlhf.topology.groups import build_model_process_groups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--ckpt", type=Path, required=True, help="megatron_rlhf checkpoint")
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for config.json and model.safetensors")
    parser.add_argument("--tokenizer-dir", type=Path,
                        help="copy its tokenizer files (default: the checkpoint's HF source)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load at")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Export; every rank runs this (collective)."""
    args = parse_args(argv)
    if (args.out / "model.safetensors").exists():
        raise FileExistsError(f"{args.out} already holds a model; choose an empty directory")
    initialize_runtime(RuntimeConfig())
    info = read_checkpoint_info(args.ckpt)
    description = info.model
    pg_collection = build_model_process_groups(description.model_spec("actor", args.tp, args.pp))
    model = build_gpt_model(description.arch, description.build_options(), pg_collection)
    load_model_checkpoint(model, pg_collection, args.ckpt)
    full_state = gather_full_state(model, pg_collection)
    if dist.get_rank() == 0:
        hf_state = full_state_to_hf(full_state, description)
        tokenizer_dir = args.tokenizer_dir or info.metadata.get("source")
        save_hf_checkpoint(args.out, description, hf_state, info.metadata.get("hf_config"),
                           tokenizer_dir=tokenizer_dir)
        print(f"wrote {args.out} ({len(hf_state)} tensors, {description.params_dtype}) "
              f"from {args.ckpt} (role {info.metadata['role']})")
    dist.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:
        destroy_distributed()
