"""Convert a Hugging Face checkpoint into a megatron_rlhf checkpoint at a chosen TP/PP.

    # one process, TP=1 PP=1 (CPU or one GPU)
    python tools/convert_hf_to_megatron.py --hf-dir llama-hf --out ckpt/actor --role actor
    # TP=2 PP=2 on CPU: four gloo ranks on this machine
    torchrun --nproc-per-node 4 tools/convert_hf_to_megatron.py --hf-dir llama-hf \
        --out ckpt/actor --tp 2 --pp 2
    # on a GPU node the same command line uses NCCL, one GPU per rank

The checkpoint loads at any TP/PP later (load_model_checkpoint reshards); --tp/--pp only choose
the layout the conversion runs and saves at, which bounds each rank's memory. Run it with
tp * pp ranks (a multiple works: the extra ranks are data-parallel replicas). The input must be
``config.json`` plus ``model.safetensors`` (or a safetensors index) as ``save_pretrained`` writes
them, of a family docs/models.md lists (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral;
``...ForSequenceClassification`` becomes a scalar head); the original config.json is kept in the
checkpoint metadata for the way back (tools/convert_megatron_to_hf.py).
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

from megatron_rlhf.models.checkpoint import save_model_checkpoint  # noqa: E402
from megatron_rlhf.models.gpt import build_gpt_model  # noqa: E402
from megatron_rlhf.models.hf_config import read_hf_config  # noqa: E402
from megatron_rlhf.models.hf_llama import hf_to_full_state, load_hf_state  # noqa: E402
from megatron_rlhf.models.weights import load_full_state  # noqa: E402
from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime  # noqa: E402
from megatron_rlhf.runtime.distributed import destroy_distributed  # noqa: E402
from megatron_rlhf.topology.groups import build_model_process_groups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--hf-dir", type=Path, required=True,
                        help="directory with config.json and model.safetensors")
    parser.add_argument("--out", type=Path, required=True,
                        help="checkpoint directory to create (must not exist)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at")
    parser.add_argument("--role", default="actor",
                        help="role recorded in the checkpoint metadata (actor, reference, ...)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Convert; every rank runs this (collective)."""
    args = parse_args(argv)
    initialize_runtime(RuntimeConfig())
    description, config = read_hf_config(args.hf_dir)
    pg_collection = build_model_process_groups(description.model_spec("actor", args.tp, args.pp))
    model = build_gpt_model(description.arch, description.build_options(), pg_collection)
    full_state = hf_to_full_state(load_hf_state(args.hf_dir), description, str(args.hf_dir))
    load_full_state(model, pg_collection, full_state)
    metadata = {"role": args.role, "source": str(args.hf_dir.resolve()), "hf_config": config}
    info = save_model_checkpoint(model, pg_collection, args.out, metadata)
    if dist.get_rank() == 0:
        print(f"wrote {args.out} (tp={info.tp_size} pp={info.pp_size}, {len(info.files)} files) "
              f"from {args.hf_dir}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:
        print(f"convert_hf_to_megatron: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        destroy_distributed()
