"""A run scored by rules and reward functions alone (``reward.model_weight=0``) places, prices and
runs no reward model.

The configuration refuses a reward checkpoint at weight 0; every placement plans the three models
of PPO (actor, critic, ref) or the two of GRPO (actor, ref), plus the shadows under separation;
the planner prices those models only. On two gloo ranks a GRPO run scored by a reward function
builds no reward model, runs no experience pass named ``reward`` (the reference model's ranks
score the answers), logs no reward-model score, and gives the same metrics under flattening and
separation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.algorithms import PPOAlgorithmConfig
from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.helpers.metrics import assert_metrics_match
from tests.multirank import run_on_ranks

RULE_ONLY = RewardConfig(model_weight=0.0, rule="synthetic")
HETERO = ClusterSpec((DevicePool("fast", nodes=1, devices_per_node=2, relative_speed=1.0),
                      DevicePool("slow", nodes=1, devices_per_node=2, relative_speed=0.5)))


def _run_config(estimator: str = "gae", **changes) -> RunConfig:
    fields = {"algorithm": PPOAlgorithmConfig(advantage_estimator=estimator),
              "rollout": RolloutConfig(samples_per_prompt=2), "reward": RULE_ONLY, **changes}
    return RunConfig(**fields)


def test_a_reward_checkpoint_at_weight_zero_is_refused_naming_both_fields(tmp_path) -> None:
    with pytest.raises(ValueError, match=(
            r"models.reward_checkpoint=.* reward.model_weight=0 runs no reward model: set "
            r"reward.model_weight > 0 .* or drop models.reward_checkpoint")):
        _run_config(models=ModelsConfig(reward_checkpoint=str(tmp_path)))
    config = _run_config(models=ModelsConfig(reward_checkpoint=str(tmp_path)),
                         reward=RewardConfig(model_weight=0.5))
    assert config.placement.reward


def test_the_tool_refuses_a_reward_checkpoint_at_weight_zero(tmp_path, capsys) -> None:
    from tools import run_ppo as run_ppo_tool

    code = run_ppo_tool.main(["--config", "examples/ppo_tiny.yaml",
                              f"models.reward_checkpoint={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "reward.model_weight=0" in err and "drop models.reward_checkpoint" in err


@pytest.mark.parametrize("changes, message", [
    ({"placement": PlacementConfig(parallel={"reward": {"tp": 1}})},
     r"placement.parallel\['reward'\] is set, but this run places no reward model"),
    ({"placement": PlacementConfig(reward=False), "reward": RewardConfig(model_weight=1.0)},
     r"placement.reward=false but reward.model_weight=1.0 scores with a reward model"),
])
def test_reward_model_options_without_one_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _run_config(**changes)


@pytest.mark.parametrize("estimator, trained", [("gae", ["actor", "critic"]), ("grpo", ["actor"])])
@pytest.mark.parametrize("strategy", ["flattening", "interleaving", "interleaving2", "separation",
                                      "async-separation", "hetero-separation"])
def test_every_placement_plans_the_models_without_a_reward_model(strategy: str, estimator: str,
                                                                  trained: list[str]) -> None:
    if strategy == "interleaving2" and estimator == "grpo":
        pytest.skip("interleaving2 trains actor || critic: refused without a critic")
    config = _run_config(estimator, placement=PlacementConfig(
        "separation" if strategy == "async-separation" else strategy),
        rollout=RolloutConfig(samples_per_prompt=2,
                              async_rollout=strategy == "async-separation"))
    assert not config.placement.reward
    cluster = HETERO if strategy == "hetero-separation" else ClusterSpec.homogeneous(1, 4)
    plan = make_plan(config, cluster)
    shadows = [f"shadow_{role}" for role in trained] if config.placement.separated else []
    assert sorted(plan.models) == sorted([*trained, "ref", *shadows])
    assert plan.to_dict()["placement"]["reward"] is False
    with_rm = make_plan(_run_config(estimator, placement=PlacementConfig(
        config.placement.strategy), reward=RewardConfig(model_weight=1.0)), cluster)
    assert set(with_rm.models) - set(plan.models) == {"reward"}


def test_a_ratio_list_keeps_its_length_and_its_reward_entry_is_unused() -> None:
    cluster = ClusterSpec.homogeneous(1, 4)
    ppo = make_plan(_run_config(placement=PlacementConfig("custom", ratios=[1, 1, 0.5, 0.5])),
                    cluster)
    grpo = make_plan(_run_config("grpo", placement=PlacementConfig("custom",
                                                                   ratios=[1, 0.5, 0.25])),
                     cluster)
    ranges = {role: (m.ranks.start, m.ranks.stop) for role, m in ppo.models.items()}
    assert ranges == {"actor": (0, 4), "critic": (0, 4), "ref": (0, 2)}
    assert {role: m.size for role, m in grpo.models.items()} == {"actor": 4, "ref": 2}


def test_the_planner_prices_and_proposes_no_reward_model() -> None:
    from megatron_rlhf.planner import RolloutSpec, SearchSpace, auto_place
    from megatron_rlhf.planner.hardware import homogeneous_cluster
    from megatron_rlhf.planner.search import candidate_configs
    from megatron_rlhf.topology import arch_preset

    cluster = homogeneous_cluster("A100-80GB", 4, 8)
    rollout = RolloutSpec(batch=256, prompt_length=128, generation_length=128)
    space = SearchSpace(tps=(4,), pps=(1, 2), critic=False, reward=False)
    configs = candidate_configs(cluster, arch_preset("llama-7b"), space)
    assert all(not c.reward and "reward" not in c.parallel for c in configs)
    # The grid's vectors differ in the reward entry only once the critic's is dropped.
    assert [c.ratios for c in configs if c.strategy == "custom" and c.pp == 1] == [
        [1.0, 0.25, 0.25], [1.0, 0.5, 0.25], [0.5, 0.25, 0.25]]
    ranked = auto_place(cluster, "llama-7b", rollout, space=space)
    assert ranked and all(set(c.plan.models) <= {"actor", "ref", "shadow_actor"} for c in ranked)
    assert all("reward" not in c.prediction.memory.roles for c in ranked if c.prediction.feasible)
    with_rm = auto_place(cluster, "llama-7b", rollout,
                         space=SearchSpace(tps=(4,), pps=(1,), critic=False))
    seconds = {c.label: c.prediction.step_seconds for c in with_rm}
    flat = next(c for c in ranked if c.label == "flattening tp=4 pp=1")
    assert flat.prediction.step_seconds < seconds["flattening tp=4 pp=1"]


PROMPTS = ("the cat sat on the mat", "the dog ran in the park", "a bird sang in the tree",
           "the sun is warm today")
COMPARED = ("reward_mean", "reward/length_tenths", "rule_score", "kl", "policy_loss",
            "response_length", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss")


def _runs(tmp_path: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.engine.run.runner import run_ppo

    root = Path(tmp_path)
    results = {}
    for strategy in ("flattening", "separation"):
        config = load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
            f"run_dir={root / strategy}", "steps=2", f"placement.strategy={strategy}",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "rollout.num_minibatches=1", "rollout.ppo_epochs=1", "generation.max_new_tokens=6",
            f"prompts.paths=[{root / 'prompts.jsonl'}]", "prompts.split.sft=0",
            "prompts.split.rm=0", "prompts.split.ppo=1", "reward.model_weight=0",
            "reward.rule=none", "reward.workers=1", "trace=true", "actor_optimizer.lr=1e-3",
            "reward.functions=[{name: 'tests.rewards.user_functions:length_tenths'}]"])
        run_dir = run_ppo(config)
        if dist.get_rank() != 0:
            continue  # rank 0 writes the run's files, after the other ranks may have returned
        timeline = json.loads((run_dir / "timeline.json").read_text())
        events = timeline["traceEvents"]
        results[strategy] = {
            "metrics": [json.loads(line) for line in
                        (run_dir / "metrics.jsonl").read_text().splitlines()],
            "plan": sorted(json.loads((run_dir / "plan.json").read_text())["models"]),
            "experience": sorted({e["args"]["model"] for e in events
                                  if e.get("cat") == "experience"})}
    return results


@pytest.mark.multirank
@pytest.mark.timeout(660)
def test_a_function_scored_grpo_run_builds_no_reward_model_on_two_ranks(tmp_path: Path) -> None:
    with (tmp_path / "prompts.jsonl").open("w") as out:
        for prompt in PROMPTS:
            out.write(json.dumps({"prompt": prompt}) + "\n")
    per_rank = run_on_ranks(_runs, world_size=2, args=(str(tmp_path),), timeout_s=600)
    runs = per_rank[0]
    assert runs["flattening"]["plan"] == ["actor", "ref"]
    assert runs["separation"]["plan"] == ["actor", "ref", "shadow_actor"]
    for strategy, run in runs.items():
        assert run["experience"] == sorted(
            ["actor" if strategy == "flattening" else "shadow_actor", "ref"]), strategy
        assert len(run["metrics"]) == 2
        for record in run["metrics"]:
            assert not [key for key in record if "rm_score" in key], (strategy, record)
            # The function's score is the whole reward (weight 1, no rule, no model).
            assert record["reward_mean"] == pytest.approx(record["reward/length_tenths"])
            assert record["rule_score"] == 0.0
    reference = runs["flattening"]["metrics"]
    assert abs(reference[1]["kl"]) > 1e-5, "the policy moved: step 2 must show a KL"
    for step, (got, want) in enumerate(zip(runs["separation"]["metrics"], reference,
                                           strict=True)):
        assert_metrics_match(got, want, COMPARED, f"separation step {step}")


def test_the_planning_tool_places_and_ranks_no_reward_model(capsys) -> None:
    from tests.scripts import load_script

    tool = load_script("tools/plan_placement.py")
    tool.main(["--nodes", "1", "--gpus-per-node", "4", "--model", "tiny", "--placement",
               "1,1,0.5,0.5", "--no-reward", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert sorted(plan["models"]) == ["actor", "critic", "ref"]
    tool.main(["--nodes", "1", "--gpus-per-node", "4", "--model", "llama-7b", "--auto",
               "--batch", "64", "--no-critic", "--no-reward", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert set(body["best"]["memory_options"]) == {"actor", "ref"}
