"""The planner's mixture-of-experts arithmetic: parameters (all and active), memory over the
expert-parallel group, FLOPs of the active parameters, the token dispatcher's all-to-alls."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.planner import RolloutSpec, predict_step
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.topology import (
    ClusterSpec,
    DevicePool,
    ModelSpec,
    ParallelOverride,
    PlacementConfig,
    flops,
    plan_placement,
)
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec
from tests.multirank import run_on_ranks
from tests.planner.helpers import ROUND

LINK_100 = cm.Link(bytes_per_s=100e9, latency_s=0.0)
MOE = ArchSpec("moe", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512,
               seq_length=64, ffn_hidden_size=128, gated_mlp=True, num_query_groups=2,
               head_dim=32, qk_norm=True,
               experts=ExpertSpec(num_experts=6, topk=2, ffn_hidden_size=32, shared_ffn_size=48))
"""2 layers of 6 experts (top-2, 32 wide) and a 48-wide shared expert; 4 heads of 32 channels
(queries 128 wide at hidden 64), 2 KV heads, per-head q/k norms."""


def test_parameters_are_counted_by_hand() -> None:
    attention = 64 * 128 + 2 * 64 * 64 + 128 * 64  # q, k, v (2 KV heads of 32), output
    attention += 4 * 64 + 2 * 32  # the planner's 4h biases, q and k norms
    router, expert, shared = 64 * 6, 3 * 64 * 32, 3 * 64 * 48
    norms = 2 * 64
    layer = attention + router + 6 * expert + shared + norms
    outside = 512 * 64 * 2 + 64  # embedding, output layer, final norm
    assert MOE.num_params() == 2 * layer + outside == 208_576
    assert MOE.expert_params() == 2 * 6 * expert == 73_728
    # a token passes through 2 of the 6 experts
    assert MOE.num_params(active=True) == MOE.num_params() - 2 * 4 * expert == 159_424
    # a token's matrix products: all but the embedding lookup, the biases and the norms
    assert flops.matmul_weights(MOE) == 159_424 - 512 * 64 - 2 * (4 * 64 + 2 * 32 + norms) - 64


def test_qwen3_30b_a3b_has_3_3b_active_parameters() -> None:
    arch = ArchSpec("qwen3-30b-a3b", 48, 2048, 32, 151936, 40960, 6144, gated_mlp=True,
                    num_query_groups=4, head_dim=128, qk_norm=True,
                    experts=ExpertSpec(128, 8, 768))
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128 + 2 * 2048  # + norms
    expert = 3 * 2048 * 768
    embeddings = 2 * 151936 * 2048 + 2048
    # the model card's 30.5B (30,532,122,624 in its safetensors) and the planner's 4h biases
    assert arch.num_params() == 48 * (attention + 2048 * 128 + 128 * expert) + embeddings + (
        48 * 4 * 2048) == 30_532_122_624 + 48 * 4 * 2048
    active = 48 * (attention + 2048 * 128 + 8 * expert) + embeddings + 48 * 4 * 2048
    assert arch.num_params(active=True) == active
    assert 3.3e9 < active < 3.4e9


def _megatron_counts() -> dict[int, tuple[int, int]]:
    """Per EP size, this rank's (parameters, expert parameters) of ``MOE`` built by megatron."""
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from tests.model_fixtures import whole_world_groups

    initialize_runtime()
    options = ModelBuildOptions(params_dtype="float32")  # the experts are MOE's
    counts = {}
    for ep in (1, 2):
        groups = whole_world_groups(1, 1, ep=ep)
        model = build_gpt_model(MOE, options, groups)
        named = list(model.named_parameters())
        counts[ep] = (sum(p.numel() for _, p in named),
                      sum(p.numel() for name, p in named
                          if ".experts." in name and "shared" not in name))
    return counts


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_megatron_builds_the_counted_parameters_on_each_expert_rank() -> None:
    per_rank = run_on_ranks(_megatron_counts, world_size=2, timeout_s=110)
    biases = MOE.num_layers * 4 * MOE.hidden_size  # the planner counts them, megatron has none
    for counts in per_rank:
        for ep, (params, experts) in counts.items():
            spec = ModelSpec("actor", MOE, trainable=True, ep=ep)
            assert params == spec.device_params() - biases, ep
            assert experts == MOE.expert_params() // ep, ep


def test_states_per_device_fall_with_ep_as_megatron_shards_them() -> None:
    total, experts = MOE.num_params(), MOE.expert_params()
    dense = total - experts
    for ep in (1, 2, 3, 6):
        states = cm.state_bytes(total, 1, 1, 6, True, cm.DISTRIBUTED_OPTIMIZER, experts, ep)
        held = dense + experts / ep
        assert states.weights == pytest.approx(2 * held)
        assert states.grads == pytest.approx(4 * held)
        # Adam's state: dense parameters over 6 DP ranks, experts over the 6 / ep holding them
        assert states.optimizer == pytest.approx(12 * (dense / 6 + experts / ep / (6 / ep)))
        spec = ModelSpec("actor", MOE, trainable=True, ep=ep)
        assert spec.bytes_per_device(dp=6) == pytest.approx(states.total)
        inference = cm.state_bytes(total, 1, 1, 6, False, expert_params=experts, ep=ep)
        assert inference.total == pytest.approx(2 * held)
    one, six = (cm.state_bytes(total, 1, 1, 6, True, expert_params=experts, ep=ep).total
                for ep in (1, 6))
    assert one - six == pytest.approx(6 * experts * (1 - 1 / 6))


def test_a_plan_with_ep_holds_less_per_gpu() -> None:
    cluster = ClusterSpec((DevicePool("A100-80GB", 1, 6, memory_gib=80.0),))
    rollout = RolloutSpec(batch=48, prompt_length=16, generation_length=16, micro_batch_size=2)
    weights = {}
    for ep in (1, 2, 3, 6):
        config = PlacementConfig("flattening", ac_share=True, reward=False, parallel={
            role: ParallelOverride(ep=ep) for role in ("actor", "ref")})
        plan = plan_placement(cluster, config, MOE)
        prediction = predict_step(plan, rollout, ROUND)
        assert prediction.feasible
        weights[ep] = prediction.memory.roles["actor"].weights * 2**30
    dense = MOE.num_params() - MOE.expert_params()
    for ep, held in weights.items():
        assert held == pytest.approx(2 * (dense + MOE.expert_params() / ep))
    assert weights[1] > weights[2] > weights[3] > weights[6]
    with pytest.raises(ValueError, match=r"actor.ep\(4\) does not divide num_experts\(6\)"):
        ModelSpec("actor", MOE, trainable=True, ep=4)
    # the expert groups of a dense model hold no experts: its states do not change
    dense = ModelSpec("actor", dataclasses.replace(MOE, experts=None), True, ep=2)
    assert dense.device_params() == dense.num_params()


def test_active_flops_are_below_a_dense_model_of_the_same_size() -> None:
    # 3 x 64 x 242 = router 64 x 6 + 6 experts 3 x 64 x 32 + shared 3 x 64 x 48: the dense MLP
    # has as many parameters as the MoE layer
    dense = dataclasses.replace(MOE, experts=None, ffn_hidden_size=242)
    assert dense.num_params() == MOE.num_params()
    tokens, context = 1000, 32
    moe_flops, dense_flops = (cm.forward_flops(a, tokens, context) for a in (MOE, dense))
    # a token skips 4 of the 6 experts in each of the 2 layers: 2 FLOPs per skipped weight
    assert dense_flops - moe_flops == tokens * 2 * (2 * 4 * 3 * 64 * 32)
    assert moe_flops < dense_flops


def _env(ep: int, arch: ArchSpec = MOE, dp: int = 6) -> cm.ModelEnv:
    return cm.ModelEnv(arch, 1, 1, dp, False, ROUND, LINK_100, LINK_100, LINK_100,
                       ep=ep, ep_link=LINK_100 if ep > 1 else None)


def test_dispatcher_all_to_alls_cost_nothing_at_ep_1() -> None:
    tokens = 1000
    assert cm.dispatch_seconds(MOE, tokens, 1, LINK_100) == 0.0
    assert cm.dispatch_seconds(dataclasses.replace(MOE, experts=None), tokens, 4, LINK_100) == 0
    assert _env(1).slot_cost(tokens, 32, passes=3, tp_collectives=4).comm == 0.0
    # ep=2: each all-to-all sends half of 2 bytes x 1000 tokens x top-2 x 64 at 100 GB/s
    one = 0.5 * 2 * tokens * 2 * 64 / 100e9
    assert cm.dispatch_seconds(MOE, tokens, 2, LINK_100) == pytest.approx(one)
    forward = _env(2).slot_cost(tokens, 32, passes=1, tp_collectives=2)
    training = _env(2).slot_cost(tokens, 32, passes=3, tp_collectives=4)
    assert forward.comm == pytest.approx(2 * 2 * one)  # dispatch + combine in 2 layers
    assert training.comm == pytest.approx(2 * 4 * one)  # and their backward
    assert training.compute == _env(1).slot_cost(tokens, 32, 3, 4).compute


def test_decoding_reads_the_experts_its_tokens_use() -> None:
    experts, held = MOE.expert_params(), MOE.num_params() - MOE.expert_params()
    # one sequence: 2 of 6 experts per layer; 3 sequences on each of 2 EP ranks: 6 tokens
    for ep, sequences, share in ((1, 1, 1 / 3), (2, 3, 1 - (2 / 3) ** 6)):
        assert cm.experts_touched(MOE, ep * sequences) == pytest.approx(share)
        cost = cm.decode_step_cost(_env(ep), sequences, context=0)
        weights = 2 * (held + share * experts / ep)
        assert cost.memory == pytest.approx(weights / 1e12)
    assert cm.experts_touched(MOE, 10_000) == pytest.approx(1.0)


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_ranks() -> None:
    total, experts = MOE.num_params(), MOE.expert_params()
    seconds = cm.grad_sync_seconds(total, 1, 1, 6, cm.REPLICATED, LINK_100, experts, 3)
    dense = cm.allreduce_seconds(4 * (total - experts), 6, LINK_100)
    expert = cm.allreduce_seconds(4 * experts / 3, 2, LINK_100)
    assert seconds == pytest.approx(dense + expert)
    assert cm.grad_sync_seconds(total, 1, 1, 6, cm.REPLICATED, LINK_100, experts, 1) == (
        cm.grad_sync_seconds(total, 1, 1, 6, cm.REPLICATED, LINK_100))


def test_an_ep_needs_the_link_of_its_group() -> None:
    with pytest.raises(ValueError, match=r"ep=2 needs the ep_link"):
        cm.ModelEnv(MOE, 1, 1, 2, False, ROUND, LINK_100, LINK_100, LINK_100, ep=2)
    with pytest.raises(ValueError, match=r"topk\(7\) exceeds num_experts\(6\)"):
        ExpertSpec(6, 7, 32)


def test_plan_only_reads_models_moe_and_each_roles_ep() -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.plan_only import plan_cluster, plan_run
    from tests.scripts import REPO

    config = load_config(RunConfig, REPO / "examples" / "ppo_moe_tiny.yaml",
                         ["placement.parallel.ref.ep=1"])
    run_plan = plan_run(config, plan_cluster(config, nodes=1, gpus_per_node=4, gpu="H100-80GB"))
    actor = run_plan.plan["actor"].spec
    assert actor.arch.experts == ExpertSpec(num_experts=4, topk=2, ffn_hidden_size=256)
    assert {role: run_plan.plan[role].spec.ep for role in run_plan.plan.roles} == {
        "actor": 2, "critic": 2, "ref": 1}
    memory = run_plan.prediction.memory.roles
    tiny = actor.arch
    for role, ep in (("actor", 2), ("ref", 1)):
        held = tiny.num_params() - tiny.expert_params() * (1 - 1 / ep)
        assert memory[role].weights * 2**30 == pytest.approx(2 * held)
    training = next(t for t in run_plan.prediction.tasks if t["name"] == "training:actor")
    assert training["comm_s"] > 0


def test_a_checkpoints_description_gives_its_experts_to_the_planner() -> None:
    from megatron_rlhf.builder.sources import arch_spec
    from megatron_rlhf.models.checkpoint import ModelDescription

    # as a format-1 megatron_rlhf.json holds it: flat, the experts as moe_* fields
    flat = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
            "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64, "head": "lm",
            "tie_embeddings": False, "norm_epsilon": 1e-5, "rotary_base": 10000,
            "params_dtype": "float32", "qk_norm": True, "head_dim": 32, "num_experts": 6,
            "moe_topk": 2, "moe_ffn_hidden_size": 32, "moe_shared_ffn_size": 48}
    description = ModelDescription.from_dict(flat, "v1", format_version=1)
    assert arch_spec(description, "moe") == MOE
    dense = ModelDescription.from_dict(flat | {"num_experts": 0, "moe_topk": 0,
                                               "moe_ffn_hidden_size": 0,
                                               "moe_shared_ffn_size": 0}, "v1", 1)
    assert arch_spec(dense, "moe").experts is None


def test_the_search_tries_the_expert_parallel_sizes_that_divide_the_experts() -> None:
    from megatron_rlhf.planner import SearchSpace
    from megatron_rlhf.planner.search import expert_parallel_sizes

    dense = dataclasses.replace(MOE, experts=None)
    wide = dataclasses.replace(MOE, experts=ExpertSpec(128, 8, 32))
    assert expert_parallel_sizes({"actor": dense, "ref": dense}, SearchSpace()) == [1]
    assert expert_parallel_sizes({"actor": MOE, "ref": MOE}, SearchSpace()) == [1, 2, 3, 6]
    assert expert_parallel_sizes({"actor": wide}, SearchSpace()) == [1, 2, 4, 8, 16]
    assert expert_parallel_sizes({"actor": wide}, SearchSpace(max_ep=64))[-1] == 64
    assert expert_parallel_sizes({"actor": wide}, SearchSpace(eps=(8, 3))) == [1, 8]
    # every MoE model's experts must split: 6 and 128 share 2; a dense model does not count
    assert expert_parallel_sizes({"actor": MOE, "ref": wide, "reward": dense},
                                 SearchSpace()) == [1, 2]
    with pytest.raises(ValueError, match="search.max_ep=0"):
        SearchSpace(max_ep=0)


@pytest.mark.parametrize("critic", [True, False])
def test_candidates_set_ep_on_every_placed_moe_model_and_its_shadow(critic: bool) -> None:
    from megatron_rlhf.planner import SearchSpace
    from megatron_rlhf.planner.search import candidate_configs

    dense = dataclasses.replace(MOE, experts=None)
    models = {"actor": MOE, "critic": MOE, "ref": MOE, "reward": dense}
    if not critic:
        del models["critic"]
    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=2, devices_per_node=4),))
    space = SearchSpace(eps=(2,), critic=critic, tps=(1,), pps=(1,))
    configs = candidate_configs(cluster, models, space)
    with_ep = [c for c in configs if any(o.ep for o in c.parallel.values())]
    assert len(with_ep) * 2 == len(configs), "each candidate once at ep 1 and once at ep 2"
    assert {c.strategy for c in with_ep} == {c.strategy for c in configs} >= {"separation"}
    for config in with_ep:
        moe_roles = {"actor", "ref"} | ({"critic"} if critic else set())
        if config.separated:
            moe_roles |= {"shadow_actor"} | ({"shadow_critic"} if critic else set())
            assert config.parallel["shadow_actor"].tp == 1, "the shadow's TP is kept"
        assert {role: o.ep for role, o in config.parallel.items() if o.ep} == dict.fromkeys(
            moe_roles, 2), config


def test_auto_placement_gives_a_moe_model_expert_parallelism_when_it_needs_it() -> None:
    """A dense-sized MoE model that fits 8 GPUs only with its experts split: the search finds
    placements with ep > 1, labels them, and builds their expert groups."""
    from megatron_rlhf.planner import SearchSpace, auto_place

    big = ArchSpec("moe-big", 16, 2048, 16, 32000, 4096, 8192, gated_mlp=True,
                   experts=ExpertSpec(64, 2, 2048))
    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=1, devices_per_node=8),))
    rollout = RolloutSpec(batch=64, prompt_length=256, generation_length=256, micro_batch_size=1)
    space = SearchSpace(strategies=("flattening",), tps=(1,), pps=(1,), critic=False,
                        reward=False, memory_options=())
    ranked = auto_place(cluster, big, rollout, space=space)
    by_ep = {c.plan["actor"].spec.ep: c for c in ranked}
    assert sorted(by_ep) == [1, 2, 4, 8]
    assert not by_ep[1].prediction.feasible, "every expert on every GPU does not fit"
    assert ranked[0].prediction.feasible and ranked[0].plan["actor"].spec.ep > 1
    assert ranked[0].label.endswith(f"ep={ranked[0].plan['actor'].spec.ep}")
    assert "ep=" not in by_ep[1].label
    gib = {ep: c.prediction.memory.peak_gib for ep, c in by_ep.items() if ep > 1}
    assert gib[2] > gib[4] > gib[8], "states per GPU fall as the experts are split further"
