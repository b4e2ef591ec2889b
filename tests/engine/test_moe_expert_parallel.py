"""PPO and GRPO with a tiny mixture-of-experts model (4 experts, top-2) split over expert-parallel
groups (``placement.parallel.<role>.ep: 2``), on gloo ranks under flattening and separation:
the steps run with the experts of every model split over 2 data-parallel ranks (the token
dispatcher's all-to-all in every MoE layer, the expert gradients reduced over the expert-DP
group, the trainer's experts refitted into shadows of either layout), and give the metrics of
the same run at EP 1. Bad ``ep`` values are refused before any process group exists."""

from __future__ import annotations

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig, RunConfig
from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.topology.placement_config import ParallelOverride, PlacementConfig
from tests.helpers.metrics import assert_metrics_match
from tests.helpers.moe_runs import moe_steps
from tests.multirank import run_on_ranks

COMPARED = ("reward_mean", "rm_score", "kl", "returns_mean", "actor/pg_loss", "actor/grad_norm",
            "response_length")
"""Metrics that do not depend on the layout (the routers' do: balancing loss per micro-batch)."""
CRITIC = ("values_mean", "critic/vf_loss", "critic/grad_norm")


def _steps(estimator: str, strategy: str, eps: dict[str, int]) -> dict:
    engine, algorithm = moe_steps(estimator, strategy, grpo_samples=2, num_minibatches=1,
                                  eps=eps, batching="static")
    metrics = [algorithm.step(s) for s in range(2)]
    eps_built = {role: (worker.pg_collection.ep.size(), worker.pg_collection.expt_dp.size())
                 for role, worker in engine.workers.items()}
    return {"metrics": metrics, "eps": eps_built}


def _compare(got: list[dict], want: list[dict], estimator: str, what: str) -> None:
    keys = COMPARED + (CRITIC if estimator == "gae" else ())
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_metrics_match(a, b, keys, f"{estimator} {what}, step {step + 1}",
                             rel=1e-4, abs=1e-5)


@pytest.mark.multirank
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.timeout(600)
def test_expert_parallel_flattening_matches_ep1(estimator: str) -> None:
    roles = ["actor", "ref", "reward"] + (["critic"] if estimator == "gae" else [])
    ep2 = run_on_ranks(_steps, world_size=2, args=(estimator, "flattening",
                                                   dict.fromkeys(roles, 2)), timeout_s=280)
    assert ep2[0]["metrics"] == ep2[1]["metrics"]
    assert ep2[0]["eps"] == dict.fromkeys(roles, (2, 1)), ep2[0]["eps"]
    ep1 = run_on_ranks(_steps, world_size=2, args=(estimator, "flattening", {}), timeout_s=280)
    _compare(ep2[0]["metrics"], ep1[0]["metrics"], estimator, "EP 2 vs EP 1")


@pytest.mark.multirank
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.timeout(600)
def test_expert_parallel_separation_refits_into_other_layouts(estimator: str) -> None:
    """4 ranks: the trainers (EP 2) on ranks 0-1, the shadows, ref and reward on 2-3; the shadow
    actor at EP 2 for GRPO, at EP 1 for PPO (the trainer's experts refitted from 2 ranks into
    each layout), beside a shadow critic at EP 2."""
    eps = {"actor": 2, "ref": 2, "reward": 2}
    eps.update({"critic": 2, "shadow_critic": 2} if estimator == "gae" else {"shadow_actor": 2})
    separated = run_on_ranks(_steps, world_size=4, args=(estimator, "separation", eps),
                             timeout_s=280)
    assert all(r["metrics"] == separated[0]["metrics"] for r in separated)
    trainers, shadows = separated[0]["eps"], separated[2]["eps"]
    assert trainers["actor"] == (2, 1), trainers
    assert shadows["shadow_actor"] == ((2, 1) if estimator == "grpo" else (1, 2)), shadows
    flat = run_on_ranks(_steps, world_size=2, args=(estimator, "flattening", {}), timeout_s=280)
    # the first step: the same weights everywhere (later ones differ by the rounding of
    # separation's other micro-batching, amplified by routing)
    _compare(separated[0]["metrics"][:1], flat[0]["metrics"][:1], estimator,
             "separation EP 2 vs flattening EP 1")


def test_bad_expert_parallel_sizes_are_refused() -> None:
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool

    def config(ep: int, moe: MoEConfig | None = None, turns: int = 0) -> RunConfig:
        from megatron_rlhf.config.ppo_run import RolloutConfig

        rollout = (RolloutConfig(tools=[{"name": "operator:add"}], max_turns=turns,
                                 max_episode_tokens=64) if turns else RolloutConfig())
        return RunConfig(placement=PlacementConfig(parallel={"actor": ParallelOverride(ep=ep)}),
                         models=ModelsConfig(moe=moe or MoEConfig(num_experts=4)),
                         rollout=rollout)

    with pytest.raises(ValueError, match=r"placement.parallel.actor.ep=0 must be an integer"):
        config(0)
    with pytest.raises(ValueError, match=r"ep=2 splits experts, but the models are dense"):
        config(2, MoEConfig())
    with pytest.raises(ValueError, match=r"ep=3 does not divide models.moe.num_experts=4: "
                                         r"choose ep in \[1, 2, 4\]"):
        config(3)
    with pytest.raises(ValueError, match=r"models.moe.token_dispatcher=allgather with "
                                         r"placement.parallel.actor.ep=2: .*use alltoall"):
        config(2, MoEConfig(num_experts=4, token_dispatcher="allgather"))
    config(2, turns=1)  # one reply per episode: one generation call per rank
    with pytest.raises(ValueError, match=r"actor.ep=2 with multi-turn episodes .* "
                                         r"rollout.max_turns=1"):
        config(2, turns=2)
    with pytest.raises(ValueError, match=r"unknown keys \['eq'\]: use tp, pp, "
                                         r"distributed_optimizer, ep"):
        PlacementConfig(parallel={"actor": {"eq": 2}})
    four = ClusterSpec(pools=(DevicePool(devices_per_node=4),))
    # dp = 4 devices / tp 2 = 2: ep 4 does not divide it (refused when planning)
    run = config(4)
    run.placement.tp = 2
    with pytest.raises(ValueError, match=r"actor.ep\(4\) does not divide actor's data-parallel "
                                         r"size dp\(2\) .*choose ep in \{1,2\}"):
        make_plan(run, four)
    assert make_plan(config(2), four)["actor"].spec.ep == 2


def _resumed_runs(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.config.ppo_run import CheckpointConfig, RewardConfig, RolloutConfig
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig
    from tests.helpers.metrics import run_metrics

    def config(name: str, ep: int, **checkpoint) -> RunConfig:
        parallel = {role: ParallelOverride(ep=ep) for role in ("actor", "critic", "ref", "reward")}
        return RunConfig(
            runtime=RuntimeConfig(seed=7),
            placement=PlacementConfig(strategy="flattening", parallel=parallel),
            models=ModelsConfig(arch="tiny", init_seed=9,
                                moe=MoEConfig(num_experts=4, ffn_hidden_size=128)),
            rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=16,
                                  micro_batch_size=1, num_minibatches=2),
            generation=GenerationConfig(max_new_tokens=6, seed=3),
            reward=RewardConfig(model_weight=0.5, rule="synthetic"),
            checkpoint=CheckpointConfig(**checkpoint), steps=3, run_dir=f"{root}/{name}")

    run_ppo(config("A", 2))
    run_ppo(config("saving", 2, save_dir=f"{root}/ckpt", save_interval=1, keep_last=0))
    run_ppo(config("B", 2, resume_from=f"{root}/ckpt/step_00000001"))
    run_ppo(config("C", 1, resume_from=f"{root}/ckpt/step_00000001"))
    if dist.get_rank() != 0:
        return {}
    return {name: run_metrics(f"{root}/{name}") for name in ("A", "saving", "B", "C")}


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_expert_parallel_runs_save_and_resume_in_either_layout(tmp_path) -> None:
    """Experts saved from EP 2 (each rank its two) resume bit-exactly at EP 2, and at EP 1
    (every rank all four) to the rounding of the other layout."""
    runs = run_on_ranks(_resumed_runs, world_size=2, args=(str(tmp_path),), timeout_s=560)[0]
    assert [m["step"] for m in runs["A"]] == [0, 1, 2]
    assert runs["saving"] == runs["A"]
    assert runs["B"] == runs["A"][1:]
    assert [m["step"] for m in runs["C"]] == [1, 2]
    _compare(runs["C"], runs["A"][1:], "gae", "resumed at EP 1 vs EP 2")
