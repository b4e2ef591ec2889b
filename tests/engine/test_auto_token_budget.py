"""``rollout.max_tokens_per_micro_batch: auto``: the budget each model gets from its device.

The budget is recomputed here from the architecture by hand (bytes per token of a layer's stored
activations and of the logits, the states of Adam in fp32) and compared with the resolver's,
which goes through the planner's cost model; then the caps (a replica's whole step, the pipeline's
share, one row at least) and the configuration's edges.
"""

from __future__ import annotations

import logging

import pytest

from megatron_rlhf.config.ppo_run import TOKEN_BUDGET_AUTO, ModelsConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.run.micro_batching import (
    ACTIVATION_SHARE,
    BUDGET_GRANULE,
    MEMORY_SHARE,
    auto_token_budget,
)
from megatron_rlhf.generation import GenerationConfig
from megatron_rlhf.topology.models import ArchSpec, ModelSpec
from megatron_rlhf.topology.plan import ModelPlacement

ARCH = ArchSpec("budget", num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=512,
                seq_length=128, ffn_hidden_size=688, gated_mlp=True)
PROMPT, RESPONSE, ROWS = 16, 32, 64
ROW = PROMPT + RESPONSE


def _config(**models) -> RunConfig:
    return RunConfig(models=ModelsConfig(params_dtype="float32", **models),
                     rollout=RolloutConfig(prompts_per_step=ROWS, max_prompt_length=PROMPT),
                     generation=GenerationConfig(max_new_tokens=RESPONSE))


def _placement(role: str, trainable: bool, pp: int = 1, size: int = 1) -> ModelPlacement:
    return ModelPlacement(ModelSpec(role, ARCH, trainable=trainable, pp=pp), rank_offset=0,
                          size=size, ratio=1.0)


def _by_hand_training_bytes_per_token() -> float:
    """fp32, no recomputation, one pipeline stage: every layer keeps its norms' inputs and
    outputs (4h), q, k, v, the attention output (h + 2 kv + h) and SwiGLU's three ffn-wide
    tensors; the logits over the padded vocabulary and their gradient."""
    h, ffn = ARCH.hidden_size, ARCH.ffn_hidden_size
    per_layer = 4 * h + 2 * h + 2 * h + 3 * ffn  # MHA: kv width = h
    logits = 2 * ARCH.padded_vocab_size(1)
    return 4 * (ARCH.num_layers * per_layer + logits)


def _by_hand_states(trainable: bool) -> float:
    """fp32 weights; a trained model adds its fp32 gradient buffer and Adam's master weights
    and two moments (12 bytes per parameter), the distributed optimizer over one replica."""
    return ARCH.num_params() * (4 + 4 + 12 if trainable else 4)


def test_memory_bounds_the_budget_as_counted_by_hand() -> None:
    config, actor = _config(), _placement("actor", True)
    ref = _placement("ref", False)
    per_token = _by_hand_training_bytes_per_token()
    states = _by_hand_states(True) + _by_hand_states(False)
    for tokens in (300, 1000):  # memory that leaves room for about this many tokens
        memory = (tokens * per_token / ACTIVATION_SHARE + states) / MEMORY_SHARE
        expected = int(ACTIVATION_SHARE * (MEMORY_SHARE * memory - states) / per_token)
        expected -= expected % BUDGET_GRANULE
        assert auto_token_budget(config, actor, [actor, ref], memory) == expected
        assert expected in (256, 960)


def test_the_budget_is_at_most_a_replicas_step_and_at_least_a_row(caplog) -> None:
    config, actor = _config(), _placement("actor", True)
    huge = 1 << 40
    assert auto_token_budget(config, actor, [actor], huge) == ROWS * ROW
    two_replicas = _placement("actor", True, size=2)
    assert auto_token_budget(config, two_replicas, [two_replicas], huge) == ROWS // 2 * ROW
    pipelined = _placement("actor", True, pp=2, size=2)
    step = ROWS * ROW  # one replica: dp = 2 devices / pp 2
    assert auto_token_budget(config, pipelined, [pipelined], huge) == step // 4
    with caplog.at_level(logging.WARNING):
        assert auto_token_budget(config, actor, [actor], _by_hand_states(True)) == ROW
    assert "needs more activation memory" in caplog.text


def test_a_forward_only_model_gets_at_least_a_trained_ones_budget() -> None:
    config = _config()
    actor, ref = _placement("actor", True), _placement("ref", False)
    memory = (800 * _by_hand_training_bytes_per_token() / ACTIVATION_SHARE
              + _by_hand_states(True) + _by_hand_states(False)) / MEMORY_SHARE
    trained = auto_token_budget(config, actor, [actor, ref], memory)
    forward = auto_token_budget(config, ref, [actor, ref], memory)
    assert 0 < trained < forward


def test_auto_is_the_default_and_other_values_are_checked() -> None:
    assert RolloutConfig().max_tokens_per_micro_batch == TOKEN_BUDGET_AUTO
    assert RunConfig(models=ModelsConfig(packed_sequences=False)).rollout \
        .max_tokens_per_micro_batch == TOKEN_BUDGET_AUTO  # padded rows: auto means fixed rows
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch='big' must be 'auto'"):
        RolloutConfig(max_tokens_per_micro_batch="big")


def test_the_resolver_keeps_a_given_number_and_fixed_rows_for_padded_rows() -> None:
    from megatron_rlhf.engine.run.micro_batching import resolve_token_budget

    class OneModelPlan:
        def __getitem__(self, role):
            return _placement(role, True)

        def roles_on(self, rank):
            return ("actor",)

    import torch

    cpu = torch.device("cpu")
    given = RunConfig(rollout=RolloutConfig(max_tokens_per_micro_batch=384))
    assert resolve_token_budget(given, OneModelPlan(), "actor", 0, cpu) == 384
    padded = RunConfig(models=ModelsConfig(packed_sequences=False))
    assert resolve_token_budget(padded, OneModelPlan(), "actor", 0, cpu) == 0
    assert resolve_token_budget(_config(), OneModelPlan(), "actor", 0, cpu) == ROWS * ROW
