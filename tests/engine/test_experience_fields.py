"""The experience record (``engine/execution/experience_fields.py``): its table declares every
field a produced batch holds, in runs with and without a critic and a reward model; the run's
settings, not a key's presence, say which optional fields there are; a batch that lacks a
declared field or holds an undeclared one is refused by name, except what an older checkpoint
could not have written."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.engine.execution.episodes import STAT_FIELDS
from megatron_rlhf.engine.execution.experience_fields import (
    EXPERIENCE,
    FIELDS,
    SCORED,
    SPECS,
    TRAINING,
    ExperienceFeatures,
    ExperienceFields,
    check_experience,
    expected_fields,
)
from megatron_rlhf.models.moe import ROUTES
from tests.multirank import run_on_ranks


def test_the_typed_dict_and_the_table_declare_the_same_fields_once() -> None:
    assert len(SPECS) == len(FIELDS)
    assert set(ExperienceFields.__optional_keys__) == set(SPECS)
    assert {*STAT_FIELDS.values(), ROUTES} <= set(SPECS)
    flags = {flag.name for flag in dataclasses.fields(ExperienceFeatures)}
    assert {spec.when for spec in FIELDS} - {None} == flags
    assert all(spec.stages and set(spec.stages) <= {SCORED, EXPERIENCE, TRAINING}
               for spec in FIELDS)


def test_the_run_settings_say_which_optional_fields_each_stage_holds() -> None:
    plain = expected_fields(ExperienceFeatures(), SCORED)
    assert {"input_ids", "old_logprobs", "ref_logprobs", "rule_scores"} <= plain
    assert not plain & {"values", "rm_scores", "advantages", "version_offsets"}
    full = ExperienceFeatures(critic=True, reward_model=True, partial_rollouts=True,
                              proximal=True)
    assert expected_fields(full, SCORED) - plain == {"values", "rm_scores", "version_offsets"}
    assert expected_fields(full, EXPERIENCE) - plain == {
        "values", "rm_scores", "weight_version", "advantages", "returns", "kl"}
    assert expected_fields(full, TRAINING) - expected_fields(full, EXPERIENCE) == {
        "proximal_logprobs"}
    with pytest.raises(ValueError, match="unknown experience stage 'rollout'"):
        expected_fields(full, "rollout")


def test_a_missing_or_undeclared_field_is_refused_by_name() -> None:
    expected = expected_fields(ExperienceFeatures(critic=True), EXPERIENCE)
    check_experience(dict.fromkeys(expected), expected, "step 2")
    with pytest.raises(ValueError, match=r"step 2: the experience batch lacks 'values' "
                                         r"\(the critic.*when critic\)"):
        check_experience(dict.fromkeys(expected - {"values"}), expected, "step 2")
    with pytest.raises(ValueError, match=r"has unexpected 'rm_scores' \(the reward model; "
                                         r"when reward_model\), 'scratch'"):
        check_experience({**dict.fromkeys(expected), "rm_scores": 0, "scratch": 0}, expected,
                         "step 2")


def _produced(estimator: str) -> dict:
    """On one rank: the fields of a scored round and of a step's experience, beside the ones the
    run's features declare."""
    import torch

    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment

    initialize_runtime()
    critic_free = estimator == "grpo"
    config = RunConfig(
        models=ModelsConfig(arch="tiny", init_seed=9),
        algorithm=PPOAlgorithmConfig(advantage_estimator=estimator),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_prompt_length=6),
        generation=GenerationConfig(max_new_tokens=5, seed=3),
        reward=(RewardConfig(model_weight=0.0, rule="synthetic") if critic_free
                else RewardConfig()))
    engine = build_engine(config, make_plan(config, cluster_from_environment()), eos_id=3,
                          pad_id=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (4,), generator=generator).tolist() for _ in range(2)]
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=1,
                             prompts=lambda step, *_: (prompts, [0, 1]), total_steps=1,
                             rule_reward=lambda prompt, response: float(len(response) % 2))
    features = algorithm.features
    scored = engine.make_experience(engine.generate_rollout(prompts, [0, 1]), 1.0)
    experience = algorithm.produce(0)
    produced = set(experience.batch.fields)
    # As restored from a checkpoint written before weight versions were recorded.
    del experience.batch.fields["weight_version"]
    try:
        algorithm.consume(experience)
        refused = ""
    except ValueError as error:
        refused = str(error)
    experience.saved_without = frozenset({"weight_version"})
    return {"features": features, "scored": set(scored.fields), "experience": produced,
            "expected_scored": expected_fields(features, SCORED),
            "expected_experience": expected_fields(features, EXPERIENCE),
            "refused": refused, "legacy_trains": bool(algorithm.consume(experience))}


@pytest.mark.multirank
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_produced_batch_holds_exactly_the_declared_fields(estimator: str) -> None:
    (result,) = run_on_ranks(_produced, world_size=1, args=(estimator,), timeout_s=240)
    assert result["scored"] == result["expected_scored"]
    assert result["experience"] == result["expected_experience"]
    features = result["features"]
    assert (features.critic, features.reward_model) == ((True, True) if estimator == "gae"
                                                        else (False, False))
    assert ("values" in result["experience"]) == features.critic
    assert "step 1's experience, before training: the experience batch lacks 'weight_version'" \
        in result["refused"]
    assert result["legacy_trains"], "a save from before versions were recorded still trains"
