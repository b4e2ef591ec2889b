"""The one FLOP model (``topology.flops``) against a count of every matrix product by hand, and
the planner's stage compute built on it."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.topology import flops
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec
from tests.planner.helpers import ROUND

MOE = ArchSpec("tiny-moe", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
               seq_length=64, ffn_hidden_size=128, gated_mlp=True, num_query_groups=2,
               experts=ExpertSpec(num_experts=8, topk=2, ffn_hidden_size=32))
"""hidden 64, 2 layers, 4 heads of 16 channels over 2 KV groups, 8 SwiGLU experts of width 32,
top-2, no shared expert, vocabulary 256."""
LENGTHS = (4, 6)
"""Two causal sequences: 10 tokens, 4^2/2 + 6^2/2 = 26 attended positions."""


def _matmul(m: float, n: int, k: int) -> float:
    """FLOPs of ``[m, k] @ [k, n]``."""
    return 2 * m * n * k


def test_a_tiny_moe_forward_is_every_matmul_counted_by_hand() -> None:
    tokens, pairs = 10, 26
    attention = (_matmul(tokens, 64, 64)     # Q: 4 heads x 16
                 + 2 * _matmul(tokens, 32, 64)  # K and V: 2 groups x 16
                 + _matmul(tokens, 64, 64))   # output projection
    # Q K^T and A V: per head 2 x 16 FLOPs per attended (query, key) pair, 4 heads
    scores = 2 * 4 * (2 * 16 * pairs)
    router = _matmul(tokens, 8, 64)
    # each token's 2 experts: gate and up (64 -> 32) and down (32 -> 64); 6 experts idle
    experts = 2 * (2 * _matmul(tokens, 32, 64) + _matmul(tokens, 64, 32))
    head = _matmul(tokens, 256, 64)
    forward = 2 * (attention + scores + router + experts) + head
    assert forward == 2 * (245_760 + 6_656 + 10_240 + 245_760) + 327_680 == 1_344_512
    assert flops.sequence_flops(MOE, LENGTHS) == forward
    assert flops.TRAINING_PASSES * flops.sequence_flops(MOE, LENGTHS) == 3 * forward
    # a value head (critic, reward) projects to one score instead of 256 logits
    assert flops.sequence_flops(MOE, LENGTHS, value_head=True) == forward - head + _matmul(
        tokens, 1, 64)


def test_the_experts_a_token_skips_cost_nothing_and_the_router_does() -> None:
    dense = dataclasses.replace(MOE, experts=None, ffn_hidden_size=32)
    shared = dataclasses.replace(MOE, experts=ExpertSpec(8, 2, 32, shared_ffn_size=48))
    top4 = dataclasses.replace(MOE, experts=ExpertSpec(8, 4, 32))
    expert = 3 * 64 * 32
    # the same 32-wide MLP once (dense) or twice (top-2), plus the 64 x 8 router
    assert flops.matmul_weights(MOE) - flops.matmul_weights(dense) == 2 * (64 * 8 + expert)
    assert flops.matmul_weights(top4) - flops.matmul_weights(MOE) == 2 * 2 * expert
    assert flops.matmul_weights(shared) - flops.matmul_weights(MOE) == 2 * 3 * 64 * 48


def test_whole_sequences_attend_half_their_square() -> None:
    # one sequence of 6: the planner's mean context s / 2
    assert flops.sequence_flops(MOE, [6]) == flops.forward_flops(MOE, 6, 3)
    assert flops.sequence_flops(MOE, [0, 0]) == 0.0
    assert flops.sequence_flops(MOE, LENGTHS) == pytest.approx(
        flops.forward_flops(MOE, 10, 26 / 10))


@pytest.mark.parametrize("arch", [MOE, dataclasses.replace(MOE, experts=None)],
                         ids=["moe", "dense"])
def test_the_planners_stage_compute_is_the_flop_model_at_the_devices_rate(arch) -> None:
    env = cm.ModelEnv(arch, 2, 1, 1, False, ROUND, *[cm.Link(100e9, 0.0)] * 3)
    rows, seq = 4, 32
    slot = env.slot_cost(rows * seq, seq / 2, flops.TRAINING_PASSES, tp_collectives=4)
    # TP 2 splits the work over two devices
    expected = flops.TRAINING_PASSES * flops.sequence_flops(arch, [seq] * rows)
    assert slot.compute == pytest.approx(expected / (2 * ROUND.flops_per_s))
    training = cm.training_cost(env, rows, seq, rows, 1, checkpointing=True)
    assert training.compute == pytest.approx(
        flops.RECOMPUTED_TRAINING_PASSES * flops.sequence_flops(arch, [seq] * rows)
        / (2 * ROUND.flops_per_s))
