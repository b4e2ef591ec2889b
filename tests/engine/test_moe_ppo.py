"""PPO and GRPO steps with a tiny mixture-of-experts model (4 experts, top-2) in every role,
under flattening on 2 gloo ranks: the models are built with MoE layers from ``models.moe``, the
steps run (generation with the KV cache, the experience passes, training of actor and critic)
and give the same metrics on both ranks, with no KL at the first step (the policy has not
moved, and the experience's log-probs and the reference's come from the same routing)."""

from __future__ import annotations

import math

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig
from megatron_rlhf.models.moe import MoEConfig
from tests.helpers.metrics import assert_metrics_match
from tests.helpers.moe_runs import PROMPTS, moe_steps
from tests.multirank import run_on_ranks

COMPARED = ("reward_mean", "rm_score", "kl", "returns_mean", "values_mean", "actor/pg_loss",
            "actor/grad_norm", "critic/vf_loss")
"""Placement-invariant metrics; the routers' are not: megatron's balancing loss is per
micro-batch, and the expert load counts the padding of packed rows, both set by the layout."""


def _steps(estimator: str, minibatches: int = 2, strategy: str = "flattening") -> dict:
    from megatron_rlhf.models.moe import moe_routers

    engine, algorithm = moe_steps(estimator, strategy, grpo_samples=4,
                                  num_minibatches=minibatches, prompt_steps=3)
    routers = {role: len(moe_routers(worker.model)) for role, worker in engine.workers.items()}
    metrics = [algorithm.step(s) for s in range(2)]
    experience = algorithm.produce(2).batch.fields or {}  # None off the trainer ranks
    routes = experience.get("moe_routes")
    return {"routers": routers, "metrics": metrics, "replayed": engine.replayed_routes,
            "routes": None if routes is None else (tuple(routes.shape), routes.min().item(),
                                                   routes.max().item())}


@pytest.mark.multirank
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.timeout(420)
def test_moe_models_run_ppo_and_grpo_steps(estimator: str) -> None:
    per_rank = run_on_ranks(_steps, world_size=2, args=(estimator,), timeout_s=380)
    assert per_rank[0]["metrics"] == per_rank[1]["metrics"]
    routers = per_rank[0]["routers"]
    assert routers and all(count == 2 for count in routers.values()), routers
    assert ("critic" in routers) == (estimator == "gae")
    first, second = per_rank[0]["metrics"]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(second["kl"]) > 1e-6, "the policy moved: the second step shows a KL"
    for metrics in (first, second):
        assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
        # 4 experts, top-2: one expert gets between the mean and every token (2x the mean)
        assert 1.0 <= metrics["actor/moe_max_load"] <= 2.0, metrics
        assert metrics["actor/moe_load_balancing_loss"] > 0, metrics
        assert ("critic/moe_max_load" in metrics) == (estimator == "gae")


def test_moe_refuses_the_runs_hugging_face_export() -> None:
    with pytest.raises(ValueError, match="export_hf=true with models.moe.num_experts=4"):
        ModelsConfig(export_hf=True, moe=MoEConfig(num_experts=4))


def test_routing_replay_refuses_layouts_that_split_routes() -> None:
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.topology.placement_config import ParallelOverride, PlacementConfig

    def config(**fields) -> RunConfig:
        models = {"moe": MoEConfig(num_experts=4), **fields.pop("models", {})}
        return RunConfig(models=ModelsConfig(**models), **fields)

    with pytest.raises(ValueError, match="recompute.actor=full .*router_replay=false"):
        config(models={"recompute": {"actor": "full"}})
    with pytest.raises(ValueError, match="actor pp=2"):
        config(placement=PlacementConfig(pp=2))
    with pytest.raises(ValueError, match="shadow_actor tp=2 with models.sequence_parallel"):
        config(placement=PlacementConfig(strategy="separation",
                                         parallel={"shadow_actor": ParallelOverride(tp=2)}))
    config(placement=PlacementConfig(tp=2), models={"sequence_parallel": False})
    config(placement=PlacementConfig(pp=2),
           models={"moe": MoEConfig(num_experts=4, router_replay=False)})


@pytest.mark.multirank
@pytest.mark.timeout(460)
def test_moe_separation_matches_flattening_at_the_first_step() -> None:
    """Under separation the shadow actor and critic (weights synced from the trainers, experts
    included) generate and score; the first step, before routing can diverge with the weights,
    gives flattening's metrics (up to the rounding of other micro-batch sizes)."""
    flat = run_on_ranks(_steps, world_size=2, args=("gae", 2, "flattening"), timeout_s=200)
    separated = run_on_ranks(_steps, world_size=2, args=("gae", 2, "separation"),
                             timeout_s=200)
    assert separated[0]["metrics"] == separated[1]["metrics"]
    assert separated[0]["routers"] == {"actor": 2, "critic": 2}  # on rank 0; shadows on 1
    assert_metrics_match(separated[0]["metrics"][0], flat[0]["metrics"][0], COMPARED,
                         "separation vs flattening, step 1", rel=1e-3, abs=1e-5)


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_replayed_routes_make_the_first_ratio_one_up_to_rounding() -> None:
    """One mini-batch per step: the first training forward sees the weights that computed the
    old log-probs, and with the recorded routes replayed the ratio is 1 up to rounding (k3 KL
    below 1e-9, no clipping); the experience carries the routes of every row, layer and top-k slot."""
    per_rank = run_on_ranks(_steps, world_size=2, args=("grpo", 1), timeout_s=380)
    result = per_rank[0]
    assert result["replayed"] == (2, 2)
    shape, low, high = result["routes"]
    assert shape[0] == PROMPTS * 4 and shape[2:] == (2, 2) and low >= -1 and high <= 3, shape
    first = result["metrics"][0]
    # Same weights and routes, but the experience and the training forwards batch the rows
    # differently, and the CPU's kernels (chosen by shape, and not the same on every CPU) may
    # round differently: the log-probs then differ by fp32 rounding, |d| < 1e-5, and k3
    # (expm1(d) - d, about d^2 / 2) stays below 1e-9 (1.3e-15 measured on an AMD EPYC). A route
    # not replayed moves a token's log-prob by orders of magnitude more.
    assert abs(first["actor/ppo_kl"]) < 1e-9, first
    assert first["actor/pg_clipfrac"] == 0.0, first  # a ratio outside 1 +- 0.2: no rounding


def _resumed_runs(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.config.ppo_run import (
        CheckpointConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
    )
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig
    from megatron_rlhf.topology.placement_config import PlacementConfig
    from tests.helpers.metrics import run_metrics

    def config(name: str, **checkpoint) -> RunConfig:
        return RunConfig(
            runtime=RuntimeConfig(seed=7), placement=PlacementConfig(strategy="flattening"),
            models=ModelsConfig(arch="tiny", init_seed=9,
                                moe=MoEConfig(num_experts=4, ffn_hidden_size=128)),
            rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=16,
                                  micro_batch_size=1, num_minibatches=2),
            generation=GenerationConfig(max_new_tokens=6, seed=3),
            reward=RewardConfig(model_weight=0.5, rule="synthetic"),
            checkpoint=CheckpointConfig(**checkpoint), steps=3, run_dir=f"{root}/{name}")

    run_ppo(config("A"))
    run_ppo(config("saving", save_dir=f"{root}/ckpt", save_interval=1, keep_last=0))
    run_ppo(config("B", resume_from=f"{root}/ckpt/step_00000001"))
    if dist.get_rank() != 0:
        return {}
    return {name: run_metrics(f"{root}/{name}") for name in ("A", "saving", "B")}


@pytest.mark.multirank
@pytest.mark.timeout(460)
def test_moe_runs_save_and_resume_bit_exactly(tmp_path) -> None:
    """Experts, routers and their optimizer state go through the run checkpoints: 3 steps ==
    1 step + save + resume + 2 steps."""
    runs = run_on_ranks(_resumed_runs, world_size=2, args=(str(tmp_path),), timeout_s=400)[0]
    assert [m["step"] for m in runs["A"]] == [0, 1, 2]
    assert runs["saving"] == runs["A"]
    assert [m["step"] for m in runs["B"]] == [1, 2]
    assert runs["B"] == runs["A"][1:]


def test_resume_refuses_another_expert_layout(tmp_path) -> None:
    import json
    from dataclasses import asdict, replace

    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.checkpointing import check_compatible

    saved = RunConfig(models=ModelsConfig(moe=MoEConfig(num_experts=4)))
    path = tmp_path / "step_00000002"
    path.mkdir()
    (path / "rl_state.json").write_text(json.dumps(
        {"format_version": 1, "tokenizer_fingerprint": "abc",
         "config": json.loads(json.dumps(asdict(saved)))}))
    check_compatible(path, saved, "abc")
    retuned = MoEConfig(num_experts=4, aux_loss_coeff=0.1, token_dispatcher="allgather")
    check_compatible(path, replace(saved, models=replace(saved.models, moe=retuned)), "abc")
    for moe in (MoEConfig(num_experts=8), MoEConfig(num_experts=4, topk=1), MoEConfig()):
        with pytest.raises(ValueError, match="was saved with models.moe"):
            check_compatible(path, replace(saved, models=replace(saved.models, moe=moe)), "abc")
