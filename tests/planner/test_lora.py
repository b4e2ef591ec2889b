"""The planner's price of LoRA (``models.lora``) against hand computations: adapter-only
gradients and optimizer state, a frozen base's backward without weight gradients, no reference
model (the actor's base runs the reference pass), adapter-sized weight syncs."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.models.options import LoRAConfig, adapter_numel
from megatron_rlhf.planner import RolloutSpec, SearchSpace, auto_place, predict_step
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.hardware import homogeneous_cluster
from megatron_rlhf.topology import ModelSpec
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec
from megatron_rlhf.topology.placement import plan_placement
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.planner.helpers import ROUND

LINK = cm.Link(bytes_per_s=100e9, latency_s=0.0)
LLAMA8B = ArchSpec(name="llama3.1-8b", num_layers=32, hidden_size=4096, num_attention_heads=32,
                   num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256,
                   seq_length=8192, gated_mlp=True)
RANK16 = LoRAConfig(rank=16, alpha=32)
LLAMA8B_ADAPTERS = 32 * 16 * ((4096 + 48 * 128) + (4096 + 4096) + (4096 + 2 * 14336)
                              + (14336 + 4096))
"""Per layer, rank x (in + out) of qkv (4096 -> (32 + 2 * 8) heads of 128), proj, the SwiGLU
fc1 (4096 -> 2 x 14336) and fc2: 35,651,584, 0.44% of the model."""


def test_adapter_params_of_an_arch_are_rank_times_in_plus_out() -> None:
    assert RANK16.adapter_params(LLAMA8B) == LLAMA8B_ADAPTERS == 35_651_584
    assert LoRAConfig().adapter_params(LLAMA8B) == 0
    moe = dataclasses.replace(LLAMA8B, experts=ExpertSpec(num_experts=8, topk=2,
                                                          ffn_hidden_size=1024,
                                                          shared_ffn_size=2048))
    # a shared expert is what the linear_fc* targets adapt in an MoE layer, routed experts
    # take the experts.* targets
    everything = LoRAConfig(rank=2, target_modules=["linear_fc1", "linear_fc2",
                                                    "experts.linear_fc1", "experts.linear_fc2"])
    shared, routed = (4096 + 2 * 2048) + (2048 + 4096), 8 * ((4096 + 2 * 1024) + (1024 + 4096))
    assert everything.adapter_params(moe) == 32 * 2 * (shared + routed)
    assert adapter_numel(moe, everything, (8, 1024), 2048) == everything.adapter_params(moe)
    critic = LoRAConfig(rank=16, roles=["actor", "critic"])
    assert critic.role_adapters(LLAMA8B) == {"actor": LLAMA8B_ADAPTERS,
                                             "critic": LLAMA8B_ADAPTERS}


def test_states_of_a_model_with_adapters() -> None:
    # 1.6e9 weights at tp 2 pp 1 dp 4 with 8e6 adapter elements: a = 4e6 per device
    params, a = 1.6e9, 4e6
    full = cm.state_bytes(params, 2, 1, 4, trainable=True)
    lora = cm.state_bytes(params, 2, 1, 4, trainable=True, adapters=8e6)
    assert lora.weights == 2 * (0.8e9 + a) and full.weights == 2 * 0.8e9
    assert lora.grads == 4 * a                       # fp32 buffers for the adapters alone
    assert lora.optimizer == 12 * a / 4              # Adam's state sharded over dp
    replicated = cm.state_bytes(params, 2, 1, 4, True, cm.REPLICATED, adapters=8e6)
    assert replicated.optimizer == 12 * a
    shadow = cm.state_bytes(params, 2, 1, 4, trainable=False, adapters=8e6)
    assert shadow == cm.StateBytes(2 * (0.8e9 + a))
    spec = ModelSpec("actor", LLAMA8B, trainable=True, tp=2, adapter_params=LLAMA8B_ADAPTERS)
    psi, a = spec.device_params(), LLAMA8B_ADAPTERS / 2
    assert spec.bytes_per_device(dp=4) == pytest.approx(2 * psi + 6 * a + 12 * a / 4)
    assert spec.to_dict()["adapter_params"] == LLAMA8B_ADAPTERS
    with pytest.raises(ValueError, match=r"actor.adapter_params=-1 must be an integer >= 0"):
        ModelSpec("actor", LLAMA8B, trainable=True, adapter_params=-1)


@pytest.mark.parametrize("checkpointing, full_passes, lora_passes", [(False, 3, 2), (True, 4, 3)])
def test_a_frozen_base_trains_without_weight_gradients(checkpointing: bool, full_passes: int,
                                                       lora_passes: int) -> None:
    env = cm.ModelEnv(LLAMA8B, 1, 1, 4, False, ROUND, LINK, LINK, LINK)
    lora = dataclasses.replace(env, adapters=LLAMA8B_ADAPTERS)
    args = (8, 1024, 4, 1, checkpointing)
    full, adapted = cm.training_cost(env, *args), cm.training_cost(lora, *args)
    # two micro-batches of 4 x 1024 tokens: the backward of the base computes the activations'
    # gradients (1 forward) and no weight gradient (the other)
    forward = cm.forward_flops(LLAMA8B, 4 * 1024, 512) / ROUND.flops_per_s
    assert full.compute == pytest.approx(2 * full_passes * forward)
    assert adapted.compute == pytest.approx(2 * lora_passes * forward)
    # gradients reduced and Adam applied over the adapters' elements: reduce-scatter of fp32
    # gradients and all-gather of bf16 weights over dp 4, 3 step all-reduces of 4 bytes
    sync = (cm.reduce_scatter_seconds(4 * LLAMA8B_ADAPTERS, 4, LINK)
            + cm.all_gather_seconds(2 * LLAMA8B_ADAPTERS, 4, LINK)
            + 3 * cm.allreduce_seconds(4, 4, LINK))
    tp_comm = (6 if checkpointing else 4) * 32 * cm.allreduce_seconds(2 * 4096 * 4096, 1, LINK)
    assert adapted.comm == pytest.approx(sync + 2 * tp_comm)
    assert adapted.memory == pytest.approx(32 * LLAMA8B_ADAPTERS / 4 / ROUND.hbm_bytes_per_s)


def _plan(strategy: str, lora: LoRAConfig, cluster, **placement):
    config = PlacementConfig(strategy, critic=False, reward=False,
                             reference=not lora.applies_to("actor"), **placement)
    return plan_placement(cluster, config, LLAMA8B, lora.role_adapters(LLAMA8B))


def test_the_actors_base_runs_the_reference_pass_and_no_reference_model_is_priced() -> None:
    cluster = homogeneous_cluster(ROUND, 1, 8)
    rollout = RolloutSpec(batch=64, prompt_length=256, generation_length=256, micro_batch_size=4)
    full = predict_step(_plan("flattening", LoRAConfig(), cluster, tp=2), rollout, ROUND)
    lora = predict_step(_plan("flattening", RANK16, cluster, tp=2), rollout, ROUND)
    assert "ref" in full.memory.roles and set(lora.memory.roles) == {"actor"}
    tasks = {task["name"]: task for task in lora.to_dict()["tasks"]}
    assert "experience:ref" not in tasks
    # the actor computes the old log-probs and, adapters off, the reference's: two forwards of
    # its 16 rows per replica at tp 2, 4 micro-batches each
    forward = 4 * cm.forward_flops(LLAMA8B, 4 * 512, 256) / (2 * ROUND.flops_per_s)
    assert tasks["experience:actor"]["compute_s"] == pytest.approx(2 * forward, rel=1e-3)
    actor = lora.memory.roles["actor"]
    assert actor.grads * 1024**3 == pytest.approx(4 * LLAMA8B_ADAPTERS / 2)
    assert lora.memory.peak_gib < full.memory.peak_gib - 30


def test_a_shadow_receives_the_adapters_alone() -> None:
    cluster = homogeneous_cluster(ROUND, 2, 8)
    rollout = RolloutSpec(batch=64, prompt_length=256, generation_length=256, micro_batch_size=4)
    plans = {name: _plan("separation", lora, cluster, tp=8) for name, lora in
             (("full", LoRAConfig()), ("lora", RANK16))}
    syncs = {name: next(t for t in predict_step(plan, rollout, ROUND).to_dict()["tasks"]
                        if t["stage"] == "sync") for name, plan in plans.items()}
    # 8 shadow devices each receive their eighth over the nodes' 100 GB/s network
    shadow = plans["full"]["shadow_actor"]
    full_bytes = 2 * shadow.spec.device_params() * 8
    assert syncs["full"]["comm_s"] == pytest.approx(full_bytes / LINK.bytes_per_s, rel=1e-3)
    # the task rows round to 1e-4 s
    assert syncs["lora"]["comm_s"] == pytest.approx(2 * LLAMA8B_ADAPTERS / LINK.bytes_per_s,
                                                    abs=6e-5)


def test_flattening_fits_with_adapters_where_full_training_does_not() -> None:
    cluster = homogeneous_cluster("H100-80GB", 1, 2)
    rollout = RolloutSpec(batch=16, prompt_length=256, generation_length=256, micro_batch_size=1)
    space = dict(strategies=("flattening",), tps=(2,), pps=(1,), critic=False, reward=False,
                 memory_options=())
    full = auto_place(cluster, LLAMA8B, rollout, space=SearchSpace(**space))
    lora = auto_place(cluster, LLAMA8B, rollout,
                      space=SearchSpace(**space, reference=False, lora=RANK16))
    assert [c.prediction.feasible for c in full] == [False]
    assert [c.prediction.feasible for c in lora] == [True]
    assert lora[0].plan["actor"].spec.adapter_params == LLAMA8B_ADAPTERS
