"""Token-budget micro-batches (``rollout.max_tokens_per_micro_batch``) against fixed ones.

Rows of varied length grouped to fill a token budget make micro-batches of other row counts than
``micro_batch_size``; every loss is a per-token (or per-row) sum divided by the step's count, so
the gradients and the loss sums of every aggregation mode must equal the fixed micro-batching's.
One process, packed sequences (the only layout that runs micro-batches of different shapes).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.algorithms import LOSS_AGGREGATIONS, PPOAlgorithmConfig
from megatron_rlhf.config.ppo_run import ModelsConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.execution.workers import ModelWorker
from megatron_rlhf.engine.step.training_losses import actor_loss_fn
from megatron_rlhf.models.forward_backward import token_budget_microbatches
from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
from megatron_rlhf.models.weights import init_weights
from megatron_rlhf.runtime.metric_reduce import reduce
from tests.model_fixtures import TinyArch, whole_world_groups

PROMPT, RESPONSE, ROWS = 6, 10, 8


@pytest.fixture(scope="module")
def groups():
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return whole_world_groups(1, 1)


def _experience() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    prompt_lengths = torch.randint(1, PROMPT + 1, (ROWS,), generator=generator)
    response_lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=generator)
    columns = torch.arange(PROMPT + RESPONSE)
    attention = ((columns >= PROMPT - prompt_lengths[:, None])
                 & (columns < PROMPT + response_lengths[:, None])).long()
    response_mask = attention[:, PROMPT:].float()
    ids = torch.randint(4, 250, attention.shape, generator=generator) * attention
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response_mask,
            "old_logprobs": -torch.rand(ROWS, RESPONSE, generator=generator) * 5 * response_mask,
            "advantages": torch.randn(ROWS, RESPONSE, generator=generator) * response_mask}


def test_rows_fill_the_budget_in_order() -> None:
    mask = torch.tensor([[1] * 3 + [0] * 3, [1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2])
    fields = {"attention_mask": mask, "row": torch.arange(4)}
    parts = token_budget_microbatches(fields, max_tokens=8)
    assert [p["row"].tolist() for p in parts] == [[0], [1, 2], [3]]
    assert [p["row"].tolist() for p in token_budget_microbatches(fields, 4)] == [[0], [1], [2],
                                                                                [3]]


def _gradients(groups, aggregation: str, budget: int):
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype="float32"), groups)
    init_weights(model, groups, seed=5)
    trainer = ModelTrainer(model, groups, OptimizerSettings(lr=1e-4))
    worker = ModelWorker("actor", model, groups, trainer, micro_batch_size=2,
                         max_tokens_per_micro_batch=budget)
    config = PPOAlgorithmConfig(loss_aggregation=aggregation, entropy_coef=0.01)
    fields = _experience()
    result = worker.train(fields, actor_loss_fn(worker, PROMPT, 1.0, config))
    grads = {name: param.main_grad.clone() for name, param in trainer.module.named_parameters()}
    sums = {f"{name}/{part}": getattr(mean, part)
            for name, mean in reduce(result["metrics"]).items() for part in ("total", "weight")}
    return len(worker._microbatches(fields)), grads, sums


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_every_loss_aggregation_equals_fixed_micro_batches(groups, aggregation) -> None:
    fixed_count, fixed, fixed_sums = _gradients(groups, aggregation, budget=0)
    budget_count, budgeted, budget_sums = _gradients(groups, aggregation, budget=20)
    assert (fixed_count, budget_count) == (4, 5), "the budget groups rows differently"
    for name, grad in fixed.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(budgeted[name], grad, rtol=1e-4,
                                   atol=1e-5 * float(grad.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert budget_sums.keys() == fixed_sums.keys()
    # Logged metrics are token-weighted sums of each micro-batch's value: those of token means
    # split exactly; a per-row mean's (pg_loss under seq_mean_*) is a token-weighted average.
    compared = fixed_sums if aggregation == "token_mean" else ("entropy/total", "entropy/weight")
    for key in compared:
        assert budget_sums[key] == pytest.approx(fixed_sums[key], rel=1e-5, abs=1e-6), key


def test_token_budget_needs_packed_sequences() -> None:
    with pytest.raises(ValueError, match="rollout.max_tokens_per_micro_batch=-1"):
        RolloutConfig(max_tokens_per_micro_batch=-1)
    with pytest.raises(ValueError, match="models.packed_sequences=true"):
        RunConfig(models=ModelsConfig(packed_sequences=False),
                  rollout=RolloutConfig(max_tokens_per_micro_batch=64))


def test_an_equal_count_split_keeps_order_and_halves_the_heaviest() -> None:
    from megatron_rlhf.models.forward_backward import split_into_microbatches

    mask = torch.tensor([[1] * 2 + [0] * 4, [1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2])
    fields = {"attention_mask": mask, "row": torch.arange(4)}
    assert [p["row"].tolist() for p in split_into_microbatches(fields, 100, 1)] == [[0, 1, 2, 3]]
    # one budget micro-batch of 14 tokens, cut where its first rows reach half: [0, 1] | [2, 3]
    assert [p["row"].tolist() for p in split_into_microbatches(fields, 100, 2)] == [[0, 1],
                                                                                   [2, 3]]
    # the budget gives [0], [1, 2], [3]; a fourth splits the heaviest with two rows, [1, 2]
    assert [p["row"].tolist() for p in split_into_microbatches(fields, 8, 4)] == [[0], [1], [2],
                                                                                 [3]]
    with pytest.raises(ValueError, match="5 micro-batches asked of 4 rows"):
        split_into_microbatches(fields, 8, 5)
