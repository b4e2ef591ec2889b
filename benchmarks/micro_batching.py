"""Padded rows, packed rows and token budgets: the experience and training passes of one batch.

    .venv/bin/python benchmarks/micro_batching.py                  # default shape
    .venv/bin/python benchmarks/micro_batching.py --shape medium   # hidden 512

One process, TP=1, fp32, 2 intra-op threads. The actor is built as ``tools/run_ppo.py`` builds it
(``examples/ppo_tiny.yaml`` with the shape written out), once with padded rows
(``models.packed_sequences=false``) and once packed, from the same seed. The batch is ``--rows``
rows of natural lengths: prompt lengths uniform in [6, 15] tokens (the shipped task's prompts),
response lengths uniform in [4, ``--response-length``], every row left/right padded to
``--prompt-length + --response-length`` as the engine pads a rollout. For each configuration
(padded or packed with ``micro_batch_size`` in ``--micro-batches``; packed with
``rollout.max_tokens_per_micro_batch`` in ``--budgets``, 0 standing for "the whole batch"; and
``auto``, the budget the engine resolves for this model and machine) it times the experience
forward (``compute_log_prob``) and one training step (``ModelWorker.train`` with the PPO actor
loss), the median over ``--repeats`` after a warm-up. Every configuration's figures come from
the same process, so their ratios compare; the ratio column is against padded rows at
``micro_batch_size=2`` (the former default). Prints one JSON line per configuration and a
summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ppo_step import SHAPES  # noqa: E402

MICRO_SHAPES = {**SHAPES, "medium": dict(num_layers=4, hidden_size=512, num_attention_heads=8,
                                         ffn_hidden_size=1376, vocab_size=512, seq_length=128,
                                         gated_mlp=True)}


def build_worker(args: argparse.Namespace, packed: bool, budget: int | str):
    """``(worker, loss_fn, config, arch)``: the actor as run_ppo builds it with this layout and budget."""
    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.builder.sources import role_options
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.execution.workers import ModelWorker
    from megatron_rlhf.engine.step.training_losses import actor_loss_fn
    from megatron_rlhf.models.trainer import ModelTrainer
    from megatron_rlhf.topology.groups import build_model_process_groups
    from megatron_rlhf.topology.models import ArchSpec, ModelSpec

    config = load_config(RunConfig, ROOT / "examples" / "ppo_tiny.yaml", [
        "models.params_dtype=float32", f"models.packed_sequences={str(packed).lower()}",
        f"rollout.prompts_per_step={args.rows}", f"rollout.max_prompt_length={args.prompt_length}",
        "rollout.ppo_epochs=1", "rollout.num_minibatches=1",
        f"rollout.max_tokens_per_micro_batch={budget if packed else 0}",
        f"generation.max_new_tokens={args.response_length}"])
    arch = ArchSpec("micro-batching", **MICRO_SHAPES[args.shape])
    pgc = build_model_process_groups(ModelSpec("actor", arch, trainable=True))
    options = replace(role_options(config, {}, "actor"),
                      recompute=config.models.recompute_of("actor"))
    model = build_model(arch, options, pgc, runtime_seed=config.runtime.seed,
                        init_seed=config.models.init_seed)
    trainer = ModelTrainer(model, pgc, config.actor_optimizer, total_steps=1000)
    worker = ModelWorker("actor", model, pgc, trainer, config.rollout.micro_batch_size)
    loss_fn = actor_loss_fn(worker, args.prompt_length, config.generation.temperature,
                            config.algorithm)
    return worker, loss_fn, config, arch


def auto_budget(config, arch, device: torch.device) -> int:
    """``auto``'s budget for the actor alone on this process's share of the machine."""
    from megatron_rlhf.engine.run.micro_batching import auto_token_budget, device_memory_bytes
    from megatron_rlhf.topology.models import ModelSpec
    from megatron_rlhf.topology.plan import ModelPlacement

    spec = ModelSpec("actor", arch, trainable=True)
    actor = ModelPlacement(spec, rank_offset=0, size=1, ratio=1.0)
    return auto_token_budget(config, actor, [actor], device_memory_bytes(device))


def natural_batch(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    """Rows of the lengths the module docstring gives, laid out as the engine lays a rollout."""
    generator = torch.Generator().manual_seed(0)
    rows, prompt, response = args.rows, args.prompt_length, args.response_length
    prompt_lengths = torch.randint(6, min(15, prompt) + 1, (rows,), generator=generator)
    response_lengths = torch.randint(min(4, response), response + 1, (rows,),
                                     generator=generator)
    columns = torch.arange(prompt + response)
    attention = ((columns >= prompt - prompt_lengths[:, None])
                 & (columns < prompt + response_lengths[:, None])).long()
    response_mask = attention[:, prompt:].float()
    return {"input_ids": torch.randint(4, vocab, attention.shape, generator=generator) * attention,
            "attention_mask": attention, "response_mask": response_mask,
            "old_logprobs": (-6.2 + 0.1 * torch.randn(rows, response, generator=generator))
            * response_mask,
            "advantages": torch.randn(rows, response, generator=generator) * response_mask}


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(worker, loss_fn, fields, prompt_length: int, temperature: float,
            repeats: int) -> dict[str, float]:
    forward = timed(lambda: worker.compute_log_prob(fields, prompt_length, temperature), repeats)
    train = timed(lambda: worker.train(fields, loss_fn), repeats)
    return {"experience_s": round(forward, 4), "train_s": round(train, 4),
            "total_s": round(forward + train, 4)}


def configurations(args: argparse.Namespace) -> list[tuple[str, bool, int | str, int]]:
    """``(name, packed, budget, micro_batch_size)`` of every configuration measured."""
    configs = [(f"padded mbs={m}", False, 0, m) for m in args.micro_batches]
    configs += [(f"packed mbs={m}", True, 0, m) for m in args.micro_batches]
    whole = args.rows * (args.prompt_length + args.response_length)
    configs += [(f"packed budget={b or whole}", True, b or whole, 1) for b in args.budgets]
    configs.append(("packed budget=auto", True, "auto", 1))
    return configs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(MICRO_SHAPES), default="default")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    load_before = os.getloadavg()
    results = {}
    for name, packed, budget, micro_batch in configurations(args):
        torch.manual_seed(0)
        worker, loss_fn, config, arch = build_worker(args, packed, budget if budget != "auto" else 0)
        fields = natural_batch(args, worker.model.token_vocab_size)
        if budget == "auto":
            budget = auto_budget(config, arch, worker.device)
        worker.micro_batch_size = micro_batch
        worker.max_tokens_per_micro_batch = budget if packed else 0
        figures = measure(worker, loss_fn, fields, args.prompt_length,
                          config.generation.temperature, args.repeats)
        results[name] = figures
        print(json.dumps({"shape": args.shape, "config": name, "resolved_budget": budget,
                          "real_tokens": int(fields["attention_mask"].sum()), **figures}),
              flush=True)
    base = results["padded mbs=2"]["total_s"]
    print(json.dumps({
        "shape": args.shape, "rows": args.rows, "repeats": args.repeats, "threads": args.threads,
        "speedup_over_padded_mbs2": {k: round(base / v["total_s"], 2) for k, v in results.items()},
        "fastest": min(results, key=lambda k: results[k]["total_s"]),
        "loadavg": [round(x, 2) for x in (*load_before, *os.getloadavg())]}))


if __name__ == "__main__":
    main()
