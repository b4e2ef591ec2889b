"""What the CPU memory meter pays per observation: ``StateOffloader.resident_bytes``.

    .venv/bin/python benchmarks/resident_bytes.py        # one JSON line, a few seconds

One process, one trained model (the ``ppo_step.py`` default shape, fp32, distributed optimizer)
after one training step, so that its weights, gradient buffers and Adam moments all exist. Times
``resident_bytes()`` of a fresh ``StateOffloader`` (a walk over every storage of the model's
state) and of one that has answered before (the cached answer the meter gets at every stage
boundary until something is offloaded, onloaded or created), and checks both give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ppo_step import SHAPES  # noqa: E402
from megatron_rlhf.topology.models import ArchSpec, ModelSpec  # noqa: E402


def _seconds_per_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.offload import StateOffloader
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime
    from megatron_rlhf.runtime.distributed import init_distributed
    from megatron_rlhf.topology.groups import build_model_process_groups

    init_distributed()
    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    arch = ArchSpec("ppo-step", **SHAPES["default"])
    pgc = build_model_process_groups(ModelSpec("actor", arch, trainable=True))
    model = build_gpt_model(arch, ModelBuildOptions(params_dtype="float32"), pgc)
    init_weights(model, pgc, seed=0)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(lr=1e-4))
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits, batch):
        return logits.float().square().sum(), torch.tensor(logits.numel()), {}

    trainer.train_step([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], loss_fn)
    walked = StateOffloader(model, trainer).resident_bytes()
    cached = StateOffloader(model, trainer)
    if cached.resident_bytes() != walked:
        raise RuntimeError("a cached answer differs from a walk over the storages")
    print(json.dumps({
        "state_bytes": walked,
        "walk_s": round(_seconds_per_call(
            lambda: StateOffloader(model, trainer).resident_bytes(), args.calls), 6),
        "cached_s": round(_seconds_per_call(cached.resident_bytes, args.calls), 7)}))


if __name__ == "__main__":
    main()
