"""Activation recomputation changes memory, not numbers.

Training steps with ``recompute=selective`` and ``recompute=full`` must give bitwise the same
gradient norms, metrics and weights as without: megatron's ``CheckpointFunction`` runs the same
forward kernels under ``no_grad`` and replays them in the backward pass with the RNG states it
saved (the CPU stand-ins of ``runtime.cpu_compat``), so every gradient is computed from identical
activations. With dropout on, that checks the replayed dropout masks too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from megatron.core.tensor_parallel import random as mcore_random

from megatron_rlhf.config.supervised_run import SupervisedModelConfig
from megatron_rlhf.models.gpt import ModelBuildOptions, recompute_fields
from tests.model_fixtures import TinyArch, whole_world_groups
from tests.multirank import run_on_ranks

GLOBAL_BATCH = 4


def test_recompute_options_map_to_megatron_fields() -> None:
    assert recompute_fields("none") == {}
    assert recompute_fields("selective") == {"recompute_granularity": "selective"}
    assert recompute_fields("full") == {"recompute_granularity": "full",
                                        "recompute_method": "uniform", "recompute_num_layers": 1}
    with pytest.raises(ValueError, match=r"model.recompute='block': use one of"):
        ModelBuildOptions(recompute="block")
    with pytest.raises(ValueError, match=r"model.recompute='block': use one of"):
        SupervisedModelConfig(recompute="block")


def _batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, 250, (GLOBAL_BATCH, 12), generator=generator)
    lengths = torch.randint(4, 13, (GLOBAL_BATCH,), generator=generator)
    return {"input_ids": ids, "attention_mask": (torch.arange(12)[None] < lengths[:, None]).long()}


def _train(tp: int, pp: int, recompute: str, dropout: float, steps: int = 2):
    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import gather_full_state, init_weights

    pgc = whole_world_groups(tp, pp)
    torch.manual_seed(7)  # hidden dropout draws from the default generator, not megatron's tracker
    arch = TinyArch()
    # The megatron backend with dropout: attention dropout inside the recomputed core attention.
    options = ModelBuildOptions(recompute=recompute, dropout=dropout,
                                attention_backend="megatron" if dropout else "sdpa",
                                packed_sequences=not dropout)
    model = build_gpt_model(arch, options, pgc, seed=11)
    init_weights(model, pgc, seed=5)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(lr=1e-2), total_steps=steps)

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(
            logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp, arch.vocab_size)
        mask = batch["attention_mask"][:, 1:].float()
        nll = -(logprobs * mask).sum()
        return nll, mask.sum().int(), {"nll_sum": nll.detach()}

    dp_size, dp_rank = pgc.dp.size(), pgc.dp.rank()
    rows = GLOBAL_BATCH // dp_size
    results = []
    with _counting_checkpoints() as checkpoints:
        for step in range(steps):
            mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in _batch(step).items()}
            microbatches = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(rows)]
            out = trainer.train_step(microbatches, loss_fn)
            results.append((out["grad_norm"], [m["nll_sum"] for m in out["metrics"]]))
    # One checkpointed unit per layer of this stage (its layer, or its core attention) per pass.
    layers = len(trainer.model.decoder.layers)
    assert len(checkpoints) == (0 if recompute == "none" else steps * rows * layers), checkpoints
    return results, gather_full_state(trainer.model, pgc)


@contextlib.contextmanager
def _counting_checkpoints() -> Iterator[list[int]]:
    """Count megatron's recomputed forward units (``tensor_parallel.checkpoint`` calls)."""
    calls: list[int] = []
    original = mcore_random.CheckpointFunction

    class Counting(original):
        @staticmethod
        def forward(ctx, run_function, distribute_saved_activations, *args):
            calls.append(1)
            return original.forward(ctx, run_function, distribute_saved_activations, *args)

    with mock.patch.object(mcore_random, "CheckpointFunction", Counting):
        yield calls


def _compare() -> list[str]:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    checked = []
    for tp, pp, dropout in [(2, 1, 0.1), (1, 2, 0.0)]:
        reference, weights = _train(tp, pp, "none", dropout)
        for recompute in ("selective", "full"):
            label = f"tp{tp} pp{pp} dropout={dropout} recompute={recompute}"
            results, other = _train(tp, pp, recompute, dropout)
            assert results == reference, f"{label}: {results} vs {reference}"
            for name, tensor in other.items():
                assert torch.equal(tensor, weights[name]), f"{label}: {name} differs"
            checked.append(label)
    return checked


@pytest.mark.multirank
@pytest.mark.timeout(480)
def test_recompute_gives_bitwise_the_same_training_steps() -> None:
    per_rank = run_on_ranks(_compare, world_size=2, timeout_s=400)
    assert len(per_rank[0]) == 4
