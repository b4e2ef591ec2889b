"""Bytes one rank holds at rest for a trained model: DDP with the distributed optimizer against
Megatron-FSDP, and the planner's count of both.

    torchrun --nproc-per-node 2 benchmarks/fsdp_bytes.py                 # tiny, dp=2, bf16
    torchrun --nproc-per-node 2 benchmarks/fsdp_bytes.py --arch small

On every rank of a DP group over the whole world (gloo on CPU, one GPU per rank with CUDA), one
bf16 model per setting takes one training step; its gathered weights are then released
(``ModelTrainer.release_gathered_weights``) and ``StateOffloader.resident_bytes`` counts each
part (weights, gradient buffers, optimizer state). While the step ran, a hook before each
transformer layer's forward recorded the largest weights Megatron-FSDP held gathered. Rank 0
prints one JSON line per setting, with ``planner.cost_model.state_bytes`` and
``fsdp_gathered_bytes`` for the same model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_rlhf.planner import cost_model as cm  # noqa: E402
from megatron_rlhf.topology.models import ModelSpec, arch_preset  # noqa: E402


def measure(arch_name: str, fsdp: bool) -> dict:
    """This rank's bytes at rest after one step, and the largest gathered working set."""
    import torch.distributed as dist

    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.offload import PARTS, StateOffloader
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.topology.groups import build_model_process_groups

    arch = arch_preset(arch_name)
    pgc = build_model_process_groups(ModelSpec("actor", arch, trainable=True))
    model = build_gpt_model(arch, ModelBuildOptions(params_dtype="bfloat16"), pgc)
    init_weights(model, pgc, seed=0)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(lr=1e-4, fsdp=fsdp))
    offloader = StateOffloader(trainer.model, trainer)
    gathered = [0]

    def observe(*_) -> None:
        gathered[0] = max(gathered[0], trainer.gathered_weight_bytes())

    for layer in trainer.fsdp_units():
        layer.register_forward_pre_hook(observe)
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits, batch):
        return logits.float().square().mean(), torch.tensor(1), {}

    trainer.train_step([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], loss_fn)
    trainer.release_gathered_weights()
    held = {part: offloader.resident_bytes((part,)) for part in PARTS}
    sharding = cm.FULLY_SHARDED if fsdp else cm.DISTRIBUTED_OPTIMIZER
    planned = cm.state_bytes(arch.num_params(1), 1, 1, dist.get_world_size(), True, sharding)
    return {"arch": arch_name, "dp": dist.get_world_size(), "setting": sharding,
            **{f"{part}_bytes": n for part, n in held.items()},
            "total_bytes": sum(held.values()),
            "planned_bytes": {"weights": planned.weights, "grads": planned.grads,
                              "optimizer": planned.optimizer},
            "gathered_peak_bytes": gathered[0],
            "planned_gathered_bytes": cm.fsdp_gathered_bytes(arch, 1, training=False)
            if fsdp else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="tiny", help="a topology.models preset")
    args = parser.parse_args()
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime
    from megatron_rlhf.runtime.distributed import init_distributed

    init_distributed()
    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    results = [measure(args.arch, fsdp) for fsdp in (False, True)]
    import torch.distributed as dist

    if dist.get_rank() == 0:
        ddp, fsdp = results
        for result in results:
            print(json.dumps(result))
        print(json.dumps({f"fsdp_over_ddp_{key}": round(fsdp[f"{key}_bytes"]
                                                         / ddp[f"{key}_bytes"], 4)
                          for key in ("weights", "grads", "optimizer", "total")}))


if __name__ == "__main__":
    main()
