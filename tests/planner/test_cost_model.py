"""The cost model's arithmetic against hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.topology import ModelSpec, arch_preset, flops
from tests.planner.helpers import ROUND

LLAMA7B = arch_preset("llama-7b")
TINY = arch_preset("tiny")
LINK_100 = cm.Link(bytes_per_s=100e9, latency_s=0.0)


def _env(arch=LLAMA7B, tp=1, pp=1, dp=1, link=LINK_100, value_head=False) -> cm.ModelEnv:
    return cm.ModelEnv(arch, tp, pp, dp, value_head, ROUND, link, link, link)


def test_llama_7b_parameter_count_matches_the_published_model() -> None:
    # LLaMA-7B has 6,738,415,616 weights; the planner's ArchSpec also counts 4 h biases per layer.
    assert LLAMA7B.num_params() == 6_738_415_616 + 32 * 4 * 4096
    # A token's matrix products: attention 4 h^2 and MLP 3 h ffn per layer, the output layer;
    # not the embedding lookup, the norms or the biases.
    assert flops.matmul_weights(LLAMA7B) == 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096
    # A value head replaces the 32000 x 4096 output projection by 4096 weights.
    assert flops.matmul_weights(LLAMA7B, value_head=True) == (
        flops.matmul_weights(LLAMA7B) - 32000 * 4096 + 4096)


def test_forward_flops_is_two_per_weight_plus_attention() -> None:
    # tiny: 2 layers, h=64; 100 tokens attending 10 tokens each.
    expected = 100 * (2 * flops.matmul_weights(TINY) + 4 * 2 * 64 * 10)
    assert cm.forward_flops(TINY, 100, 10) == expected


def test_state_bytes_are_what_the_engine_allocates() -> None:
    params = 2e9  # psi = 1e9 per device with tp=2

    def states(trainable: bool, sharding: str) -> cm.StateBytes:
        return cm.state_bytes(params, tp=2, pp=1, dp=4, trainable=trainable, sharding=sharding)

    # Inference-only: bf16 weights, whatever the sharding of the trainable models.
    assert states(False, cm.FULLY_SHARDED) == cm.StateBytes(2e9)
    # DDP: bf16 weights, fp32 gradient buffer (grad_reduce_in_fp32), fp32 master + Adam m, v.
    assert states(True, cm.REPLICATED) == cm.StateBytes(2e9, 4e9, 12e9)        # 18 psi
    # Distributed optimizer: only the 12 bytes of optimizer state are split over dp = 4.
    assert states(True, cm.DISTRIBUTED_OPTIMIZER) == cm.StateBytes(2e9, 4e9, 3e9)
    # FSDP: all 18 bytes over dp = 4.
    assert states(True, cm.FULLY_SHARDED) == cm.StateBytes(0.5e9, 1e9, 3e9)
    with pytest.raises(ValueError, match="sharding='zero2'"):
        states(True, "zero2")
    spec = ModelSpec("actor", LLAMA7B, trainable=True, tp=2, pp=2)
    psi = spec.num_params() / 4
    assert cm.state_bytes(spec.num_params(), 2, 2, 4, True).total == pytest.approx(
        spec.bytes_per_device(dp=4)) == pytest.approx(psi * (6 + 3))
    assert cm.state_bytes(spec.num_params(), 2, 2, 4, True, cm.FULLY_SHARDED).total == (
        pytest.approx(spec.bytes_per_device(dp=4, fully_sharded=True))) == pytest.approx(
        psi * 18 / 4)


def test_fsdp_holds_two_gathered_layers_and_the_embeddings() -> None:
    from megatron_rlhf.models.trainer import FSDP_GATHERED_LAYERS

    # llama-7b layer: 4 h^2 + 4 h attention, 3 h f SwiGLU MLP, 2 h norms; outside the layers:
    # input embedding and output layer (vocabulary 32000), final norm.
    h, f = 4096, 11008
    layer = 4 * h * h + 4 * h + 3 * h * f + 2 * h
    outside = 2 * 32000 * h + h
    assert cm.layer_params(LLAMA7B) == layer
    assert cm.fsdp_gathered_bytes(LLAMA7B, 2, training=False) == 2 * (2 * layer + outside) / 2
    assert cm.fsdp_gathered_bytes(LLAMA7B, 2, training=True) == 6 * (2 * layer + outside) / 2
    assert cm.FSDP_LAYERS_GATHERED == FSDP_GATHERED_LAYERS, "the planner models the engine's"


def test_activation_and_kv_cache_formulas() -> None:
    # tiny (h=64, 4 heads, ffn=256, SwiGLU), s=128, b=2, tp=1: 2 s b (4h + 2h + 2h + 3 ffn).
    assert cm.layer_activation_bytes(TINY, 128, 2, 1) == 2 * 128 * 2 * (256 + 128 + 128 + 768)
    # llama-7b, tp=2, pp=2, one sequence of 512: K and V of 16 layers, 2048 wide, bf16.
    assert cm.kv_cache_bytes(LLAMA7B, 2, 2, 1, 512) == 2 * 16 * 2048 * 512 * 2
    checkpointed = cm.training_activation_bytes(TINY, 128, 2, 1, 1, 4, True, value_head=True)
    assert checkpointed == 2 * 2 * 128 * 2 * 64 + cm.layer_activation_bytes(TINY, 128, 2, 1)


def test_collectives_follow_the_ring_formulas() -> None:
    assert cm.allreduce_seconds(1e9, 8, LINK_100) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)
    assert cm.reduce_scatter_seconds(1e9, 8, LINK_100) == pytest.approx(7 / 8 * 1e9 / 100e9)
    assert cm.allreduce_seconds(1e9, 1, LINK_100) == 0.0
    latency = cm.Link(100e9, 1e-5)
    assert cm.allreduce_seconds(0, 8, latency) == pytest.approx(3e-5)  # log2(8) hops
    # psi = 2e9 per device. DDP all-reduces the 4 psi bytes of fp32 gradients; ZeRO-1
    # reduce-scatters them and all-gathers the 2 psi bytes of bf16 weights; FSDP reduce-scatters
    # here and gathers its weights per pass.
    ddp = cm.grad_sync_seconds(4e9, 2, 1, 8, cm.REPLICATED, LINK_100)
    zero1 = cm.grad_sync_seconds(4e9, 2, 1, 8, cm.DISTRIBUTED_OPTIMIZER, LINK_100)
    fsdp = cm.grad_sync_seconds(4e9, 2, 1, 8, cm.FULLY_SHARDED, LINK_100)
    assert ddp == pytest.approx(2 * 7 / 8 * 8e9 / 100e9)
    assert zero1 == pytest.approx(7 / 8 * 8e9 / 100e9 + 7 / 8 * 4e9 / 100e9)
    assert fsdp == pytest.approx(7 / 8 * 8e9 / 100e9)
    assert cm.fsdp_gather_seconds(4e9, 2, 1, 8, LINK_100) == pytest.approx(7 / 8 * 4e9 / 100e9)


def test_group_link_shares_the_node_network() -> None:
    inside = cm.group_link(2400, 1600, False, 8, ROUND)
    across = cm.group_link(2400, 1600, True, 8, ROUND)
    assert inside.bytes_per_s == 300e9
    assert across.bytes_per_s == pytest.approx(1600e9 / 8 / 8)  # 8 DP groups share the NICs


def test_pipeline_bubble_and_slots() -> None:
    assert cm.pipeline_bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert cm.pipeline_bubble_fraction(1, 5) == 0.0
    # 48 rows, micro-batch 4: 12 micro-batches in 12 + 1 slots on 2 stages (twice the devices),
    # so the time is half the one-stage time divided by (1 - bubble) = 12 / 13.
    flat, piped = _env(TINY), _env(TINY, pp=2)
    ideal = cm.forward_cost(flat, 48, 64, 4).compute / 2
    assert cm.forward_cost(piped, 48, 64, 4).compute == pytest.approx(
        ideal / (1 - cm.pipeline_bubble_fraction(2, 12)))


def test_decode_step_reads_the_weights_and_the_kv_cache() -> None:
    weights_s = 2 * LLAMA7B.num_params() / 1e12   # 13.5 GB at 1 TB/s
    assert cm.decode_step_cost(_env(), 1, 0).total == pytest.approx(weights_s)
    kv_s = 2 * 32 * 4096 * 1000 * 8 * 2 / 1e12    # 8 sequences at context 1000
    step = cm.decode_step_cost(_env(), 8, 1000)
    assert step.memory == pytest.approx(weights_s + kv_s) and step.compute == 0.0
    # A batch large enough becomes compute-bound.
    assert cm.decode_step_cost(_env(), 4096, 10).compute > 0


def test_generation_runs_in_rounds_bounded_by_the_kv_cache() -> None:
    env = _env(TINY)
    one_round = cm.generation_cost(env, 8, 16, 32, max_sequences=8)
    two_rounds = cm.generation_cost(env, 8, 16, 32, max_sequences=4)
    half = cm.generation_cost(env, 4, 16, 32, max_sequences=4)
    assert two_rounds.total == pytest.approx(2 * half.total)
    assert one_round.total < two_rounds.total


def test_training_is_three_forward_passes_plus_the_adam_update() -> None:
    env = _env(TINY)
    forward = cm.forward_flops(TINY, 8 * 64, 32) / 100e12
    update = cm.ADAM_UPDATE_BYTES * TINY.num_params() / 1e12
    cost = cm.training_cost(env, 8, 64, 8, 1, checkpointing=False)
    assert cost.total == pytest.approx(3 * forward + update)
    recompute = cm.training_cost(env, 8, 64, 8, 2, checkpointing=True)
    assert recompute.compute == pytest.approx(4 * forward)  # 2 steps of half the rows
    # Every epoch trains on every row again: two epochs of 2 mini-batches are 4 optimizer steps
    # of half the rows each, twice one epoch's cost (not 4 steps of a quarter of the rows).
    twice = cm.training_cost(env, 8, 64, 8, 2, checkpointing=True, epochs=2)
    assert twice.total == pytest.approx(2 * recompute.total)
    assert twice.compute == pytest.approx(8 * forward)
    # Each optimizer step also pays the profile's fixed step latency.
    slow = dataclasses.replace(env, profile=dataclasses.replace(env.profile, step_latency_s=0.01))
    stepped = cm.training_cost(slow, 8, 64, 8, 2, checkpointing=True)
    assert stepped.overhead - recompute.overhead == pytest.approx(2 * 0.01)


def test_model_calls_and_small_step_collectives_pay_their_latencies() -> None:
    # tiny has 2 layers; 1 ms per layer call and 3 ms per model call, nothing else costs time.
    slow = dataclasses.replace(ROUND, peak_tflops=1e9, hbm_gb_per_s=1e9, layer_latency_s=1e-3,
                               call_latency_s=3e-3)
    env = cm.ModelEnv(TINY, 1, 1, 1, False, slow, LINK_100, LINK_100, LINK_100, cm.REPLICATED)
    # A forward micro-batch: 2 layer calls and one model call; forward+backward: 3 of each.
    assert cm.forward_cost(env, 4, 16, 4).overhead == pytest.approx(2e-3 + 3e-3)
    assert cm.training_cost(env, 4, 16, 4, 1, False).overhead == pytest.approx(
        3 * (2e-3 + 3e-3))
    # A decode step: its 2 layers and one call (model and sampling), per new token.
    assert cm.decode_step_cost(env, 4, 20).overhead == pytest.approx(2e-3 + 3e-3)
    # With DP 4 over a 1 ms link, an optimizer step adds 3 latency-bound all-reduces (2 ms each:
    # log2 4 latencies) to the reduce-scatter and all-gather of the gradients.
    link = cm.Link(bytes_per_s=1e30, latency_s=1e-3)
    dp4 = cm.ModelEnv(TINY, 1, 1, 4, False, ROUND, link, link, link)
    comm = cm.training_cost(dp4, 8, 16, 2, 1, False).comm
    assert comm == pytest.approx((2 + cm.STEP_ALLREDUCES) * 2e-3)
    assert cm.training_cost(_env(TINY), 8, 16, 2, 1, False).comm == 0.0  # DP 1
    # FSDP, 4 micro-batches of 2 rows: each gathers the weights for its forward and its backward
    # and reduce-scatters its gradients (12 collectives), besides the 3 small all-reduces; a
    # forward pass gathers once per micro-batch, a generation once.
    fsdp = dataclasses.replace(dp4, sharding=cm.FULLY_SHARDED)
    assert cm.training_cost(fsdp, 8, 16, 2, 1, False).comm == pytest.approx(
        (3 * 4 + cm.STEP_ALLREDUCES) * 2e-3)
    assert cm.forward_cost(fsdp, 8, 16, 2).comm == pytest.approx(4 * 2e-3)
    assert cm.generation_cost(fsdp, 8, 4, 4, 8).comm == pytest.approx(2e-3)


def test_weight_sync_and_offload() -> None:
    # 1e9 params into a tp=2 shadow of 8 devices on 1 node, from 2 trainer nodes.
    seconds = cm.weight_sync_seconds(1e9, 2, 1, 8, 1, 2, LINK_100)
    assert seconds == pytest.approx(8 * 2e9 / 2 / 100e9)   # the receiving node takes 8 shards
    slow = cm.Link(bytes_per_s=100e9, latency_s=0.01)        # the latency is paid once
    assert cm.weight_sync_seconds(1e9, 2, 1, 8, 1, 2, slow) == pytest.approx(seconds + 0.01)
    # One use: 8 GB onto the device and back at 10 GB/s.
    assert cm.offload_seconds(8e9, ROUND) == pytest.approx(2 * 8e9 / 10e9)
    assert math.isclose(cm.Cost(1, 2, 3, 4, 5).total, 15)
