"""Held-out evaluation: which model each number comes from, where it is recorded, and the
reward-hacking check."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_rlhf.config.ppo_run import EvalConfig
from megatron_rlhf.engine.run.evaluation import MODES, answering_config, hacking_report
from megatron_rlhf.generation import GenerationConfig
from tests.multirank import run_on_ranks

FIRST = {"eval/greedy/rm_score": -3.0, "eval/greedy/rm_score_std": 1.0,
         "eval/greedy/rule_score": 0.30, "eval/greedy/answers": 16.0,
         "eval/sampled/rm_score": -5.0, "eval/sampled/rm_score_std": 2.0,
         "eval/sampled/rule_score": 0.40, "eval/sampled/answers": 16.0}
"""16 answers a mode: the sampled mean's change has a standard error of sqrt((4 + 4) / 16) =
0.71 while the scores keep their spread, so two standard errors are a rise of 1.41."""


def test_hacking_report_names_the_mode_whose_scores_diverge() -> None:
    hacked = {**FIRST, "eval/sampled/rm_score": -3.5, "eval/sampled/rule_score": 0.20}
    (line,) = hacking_report(FIRST, hacked, tolerance=0.02, rm_rise=2.0)
    assert line.startswith("sampled answers") and "-5.000 -> -3.500" in line
    assert "0.400 -> 0.200" in line


@pytest.mark.parametrize("change", [
    {"eval/sampled/rm_score": 0.0, "eval/sampled/rule_score": 0.39},    # rule within tolerance
    {"eval/sampled/rm_score": -3.7, "eval/sampled/rule_score": 0.1},    # rise 1.3 < 1.41
    {"eval/sampled/rm_score": -6.0, "eval/sampled/rule_score": 0.1},    # both fell: no hacking
    {"eval/greedy/rm_score": 0.0, "eval/greedy/rule_score": 0.5},       # both rose: learning
])
def test_hacking_report_is_silent_unless_reward_up_and_rule_down(change: dict) -> None:
    assert hacking_report(FIRST, {**FIRST, **change}, tolerance=0.02, rm_rise=2.0) == []


def test_a_logged_example_shows_the_scores_of_the_sources_the_run_scores_with() -> None:
    from types import SimpleNamespace

    import torch

    from megatron_rlhf.engine.run.evaluation import HeldOutEvaluator

    fields = {"rule_scores": torch.tensor([0.0, 1.0]), "rm_scores": torch.tensor([0.5, -2.0]),
              "episode_reward": torch.tensor([2.0, 0.0])}

    def scores(rule_reward, fields, environment=None) -> str:
        from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures

        # The run's settings, not the batch, say which scores there are.
        features = ExperienceFeatures(reward_model="rm_scores" in fields,
                                      episodes=environment is not None)
        engine = SimpleNamespace(episodes=None if environment is None
                                 else SimpleNamespace(environment=environment),
                                 experience_features=lambda functions: features)
        evaluator = HeldOutEvaluator(engine, [[1]], rule_reward, str)
        return evaluator._example_scores(fields, 0)

    only_rule = {"rule_scores": fields["rule_scores"]}  # rule scores are 0 without a rule
    assert scores(None, only_rule) == ""
    assert scores(len, only_rule) == " (rule 0.000)"
    assert scores(None, fields, environment="my_envs:Guess") == (
        " (reward model 0.500, environment 2.000)")


def test_hacking_threshold_is_the_standard_error_of_the_mean_change() -> None:
    """The previous default run's greedy answers at seed 0 (docs/results/main-job-history.md): the reward
    model's mean rose by 2.9 over 128 answers whose scores spread by 6.2, while the rule score
    fell by 0.16.
    A threshold in per-answer standard deviations (half of one: 3.1) missed it."""
    first = {"eval/greedy/rm_score": -10.158, "eval/greedy/rm_score_std": 6.23,
             "eval/greedy/rule_score": 0.867, "eval/greedy/answers": 128.0}
    final = {**first, "eval/greedy/rm_score": -7.250, "eval/greedy/rule_score": 0.703}
    (line,) = hacking_report(first, final, tolerance=0.03, rm_rise=2.0)
    assert "-10.158 -> -7.250" in line and "0.867 -> 0.703" in line
    written_before_answers = {k: v for k, v in first.items() if not k.endswith("/answers")}
    assert hacking_report(written_before_answers, final, 0.03, 2.0) == [line], (
        "a resumed run's first evaluation may come from a record without the answer count")
    assert hacking_report({**first, "eval/greedy/answers": 8.0},
                          {**final, "eval/greedy/answers": 8.0}, 0.03, 2.0) == [], (
        "over 8 answers the same rise is within 2 standard errors (2 x 3.1)")


@pytest.mark.parametrize(("kwargs", "field"), [({"num_prompts": -1}, "evaluation.num_prompts"),
                                               ({"interval": -2}, "evaluation.interval"),
                                               ({"hacking_tolerance": -0.1},
                                                "evaluation.hacking_tolerance"),
                                               ({"hacking_rm_rise": -1.0},
                                                "evaluation.hacking_rm_rise"),
                                               ({"log_examples": -1}, "evaluation.log_examples")])
def test_eval_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EvalConfig(**kwargs)


def test_evaluations_fall_before_the_first_and_every_interval_th_step() -> None:
    assert [s for s in range(7) if EvalConfig(interval=3).due(s, start=0)] == [0, 3, 6]
    assert [s for s in range(2, 7) if EvalConfig(interval=0).due(s, start=2)] == [2]


def _chain_then_recompute(run_dir: Path) -> dict:
    """The pipeline, then its SFT and final-policy evaluations again from their checkpoints
    under another placement (flattening instead of separation: no shadow actor)."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.instructgpt import format_report, run_pipeline

    start = time.perf_counter()
    result = run_pipeline(run_dir, [], [
        "steps=3", "rollout.prompts_per_step=8", "evaluation.num_prompts=8",
        "evaluation.interval=2", f"checkpoint.save_dir={run_dir / 'ckpt'}"],
        ["train.max_steps=12"], ["train.max_steps=6"])
    elapsed = time.perf_counter() - start
    saved = run_dir / "ppo" / "config.yaml"
    flat = "placement.strategy=flattening"
    run_ppo(load_config(RunConfig, saved, [f"run_dir={run_dir / 'sft_again'}", "steps=0", flat,
                                           "checkpoint.save_dir=''"]))
    run_ppo(load_config(RunConfig, saved, [f"run_dir={run_dir / 'final_again'}",
                                           "checkpoint.resume=true", flat]))
    return {"held_out": result.held_out, "report": format_report(result),
            "stage_seconds": result.stage_seconds, "elapsed": elapsed}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_evaluation(ours: dict, again: dict) -> None:
    assert ours.keys() == again.keys() and len(ours) == 11
    for key, value in ours.items():
        assert again[key] == pytest.approx(value, abs=1e-4), key


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(660)
def test_pipeline_evaluates_untrained_sft_and_final_policies(tmp_path: Path) -> None:
    out = run_on_ranks(_chain_then_recompute, world_size=2, args=(tmp_path,), timeout_s=600)[0]
    held = out["held_out"]
    ppo = _records(tmp_path / "ppo" / "metrics.jsonl")
    # SFT learns: 12 steps of the pipeline's SFT configuration lower its loss (the quickstart's
    # run, which tests/engine/test_pipeline.py reads, trains 2).
    sft = _records(tmp_path / "sft" / "metrics.jsonl")
    assert len(sft) == 12 and sft[-1]["loss"] < sft[0]["loss"]
    # Before steps 0 and 2 (evaluation.interval=2) and after the last, in a record of its own.
    assert [r["step"] for r in ppo] == [0, 1, 2, 3]
    for key in ("reward_mean", "rm_score", "rule_score", "kl", "policy_loss", "value_loss",
                "samples_per_s"):
        assert all(key in record for record in ppo[:3]), key
    assert [any(k.startswith("eval/") for k in r) for r in ppo] == [True, False, True, True]
    assert "rm_score" not in ppo[3]
    # The SFT model: the policy PPO starts from, so it is still the reference (KL exactly 0);
    # the same numbers come from its checkpoint evaluated with no PPO step on another placement.
    assert held["sft"]["eval/sampled/kl"] == pytest.approx(0.0, abs=1e-6)
    (sft_again,) = _records(tmp_path / "sft_again" / "metrics.jsonl")
    assert sft_again.pop("step") == 0
    _assert_same_evaluation(held["sft"], sft_again)
    # The final policy: trained (it has moved from the reference; its KL is estimated from the
    # sampled tokens' log-ratios, which can sum below zero), and the same numbers come from its
    # resumable checkpoint, loaded under another placement.
    assert abs(held["ppo"]["eval/sampled/kl"]) > 1e-4
    (final_again,) = _records(tmp_path / "final_again" / "metrics.jsonl")
    assert final_again.pop("step") == 3
    _assert_same_evaluation(held["ppo"], final_again)
    # The untrained model is another network: its held-out reward-model scores differ.
    untrained = _records(tmp_path / "untrained" / "metrics.jsonl")
    assert [r["step"] for r in untrained] == [0] and held["untrained"] == {
        k: v for k, v in untrained[0].items() if k != "step"}
    assert held["untrained"]["eval/greedy/rm_score"] != held["sft"]["eval/greedy/rm_score"]
    for name in ("untrained model", "SFT model (PPO start)", "PPO final (after 3 steps)"):
        assert name in out["report"]
    # Each stage is timed once, in order, within the pipeline call's own wall clock.
    stages = out["stage_seconds"]
    assert list(stages) == ["sft", "rm", "untrained", "ppo"] and min(stages.values()) > 0
    assert sum(stages.values()) <= out["elapsed"]
    assert "wall clock: SFT (data included) " in out["report"]


def test_curves_put_held_out_points_beside_the_training_ones() -> None:
    from tests.scripts import load_script

    curves = load_script("tools/run_pipeline.py").curves
    records = [{"step": 0, "rm_score": -5.0, "rule_score": 0.4, "kl": 0.0,
                "eval/greedy/rm_score": -4.0, "eval/greedy/rule_score": 0.3,
                "eval/sampled/rm_score": -6.0, "eval/sampled/rule_score": 0.45,
                "eval/sampled/kl": 0.0},
               {"step": 1, "rm_score": -4.5, "rule_score": 0.5, "kl": 0.3},
               {"step": 2, "eval/greedy/rm_score": -3.0, "eval/greedy/rule_score": 0.2,
                "eval/sampled/rm_score": -5.0, "eval/sampled/rule_score": 0.6,
                "eval/sampled/kl": 1.5}]
    runs = curves(records)
    assert [r["step"] for r in runs["train batches"]] == [0, 1]
    assert runs["held-out (sampled)"] == [
        {"step": 0, "rm_score": -6.0, "rule_score": 0.45, "kl": 0.0},
        {"step": 2, "rm_score": -5.0, "rule_score": 0.6, "kl": 1.5}]
    assert [r["rule_score"] for r in runs["held-out (greedy)"]] == [0.3, 0.2]


def test_held_out_answers_are_all_greedy_or_all_sampled_whatever_training_mixes() -> None:
    training = GenerationConfig(temperature=0.7, greedy_every=2, seed=3)
    greedy, sampled = (answering_config(training, mode) for mode in MODES)
    assert (greedy.greedy, greedy.greedy_every) == (True, 0)
    assert (sampled.greedy, sampled.greedy_every) == (False, 0)
    assert sampled.temperature == greedy.temperature == 0.7 and sampled.seed == 3


def _flattened_plan(ranks: int):
    from megatron_rlhf.config.ppo_run import ModelsConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
    from megatron_rlhf.topology.placement_config import PlacementConfig

    config = RunConfig(placement=PlacementConfig(strategy="flattening"),
                       models=ModelsConfig(arch="tiny"),
                       rollout=RolloutConfig(prompts_per_step=8, max_prompt_length=8,
                                             micro_batch_size=2))
    return config, make_plan(config, ClusterSpec((DevicePool("local", 1, ranks),)))


def test_a_held_out_set_the_models_cannot_split_is_refused_with_a_size_that_works() -> None:
    from megatron_rlhf.engine.run.build import check_evaluation_size

    config, plan = _flattened_plan(4)     # every model dp=4, micro-batches of 2: multiples of 8
    check_evaluation_size(plan, config, 16)
    with pytest.raises(ValueError, match=r"14 held-out prompts .* use evaluation.num_prompts=8"):
        check_evaluation_size(plan, config, 14)
    with pytest.raises(ValueError, match="use at least 8 held-out prompts"):
        check_evaluation_size(plan, config, 6)


def test_held_out_files_need_only_prompts_and_a_file_with_none_usable_is_refused(
        tmp_path: Path) -> None:
    from megatron_rlhf.config.ppo_run import EvalConfig, RunConfig
    from megatron_rlhf.engine.run.runner import load_eval_prompts
    from megatron_rlhf.models.tokenizer import SHIPPED_CORPUS, Tokenizer

    tokenizer = Tokenizer.train(SHIPPED_CORPUS, 512, tmp_path / "spm.model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Write about the farm:"}\n{"prompt": "Tell me a song."}\n')
    config = RunConfig(evaluation=EvalConfig(paths=[str(prompts)], num_prompts=8))
    assert load_eval_prompts(config, tokenizer) == [
        [tokenizer.bos_id, *tokenizer.encode(text)]
        for text in ("Write about the farm:", "Tell me a song.")]
    unusable = tmp_path / "unusable.jsonl"
    unusable.write_text('{"question": "Write about the farm:"}\n')
    config = RunConfig(evaluation=EvalConfig(paths=[str(unusable)], num_prompts=8))
    with pytest.raises(ValueError, match=r"hold no usable prompt(.|\n)*kept 0 of 1 records"):
        load_eval_prompts(config, tokenizer)


def test_report_orders_each_modes_rule_score_across_the_three_models(tmp_path: Path) -> None:
    from megatron_rlhf.instructgpt import PipelineResult, format_report

    def held(greedy: float, sampled: float) -> dict[str, float]:
        return {**FIRST, "eval/greedy/rule_score": greedy, "eval/sampled/rule_score": sampled,
                "eval/sampled/kl": 0.0}

    result = PipelineResult(tmp_path, {"sft": {}, "rm": {}, "untrained": {}, "ppo": {}},
                            {"untrained": held(0.04, 0.03), "sft": held(0.87, 0.45),
                             "ppo": held(0.70, 0.45)}, 2.0, EvalConfig(),
                            {"sft": 174.4, "rm": 80.6, "untrained": 9.5, "ppo": 167.0})
    report = format_report(result)
    assert ("wall clock: SFT (data included) 174 s, reward model 81 s, untrained model's "
            "evaluation 10 s, PPO (evaluations included) 167 s") in report
    assert "sampled answers, rule score: untrained 0.030 < SFT 0.450 = PPO final 0.450" in report
    assert "greedy answers, rule score: untrained 0.040 < SFT 0.870 > PPO final 0.700" in report


def test_report_counts_each_stages_steps_from_1_as_its_progress_line(tmp_path: Path) -> None:
    """Metrics records number steps from 0; after ``SFT step 12/12`` and ``ppo: step 3/3`` the
    report says step 12 and step 3, not 11 and 2."""
    from megatron_rlhf.instructgpt import PipelineResult, format_report

    final = {"sft": {"step": 11, "eval_loss": 3.5}, "rm": {"step": 5, "eval_accuracy": 0.75},
             "untrained": {}, "ppo": {"step": 2, "rm_score": -1.0, "rule_score": 0.5, "kl": 0.25}}
    result = PipelineResult(tmp_path, final, {"untrained": FIRST, "sft": FIRST, "ppo": FIRST},
                            None, EvalConfig())
    report = format_report(result)
    assert "SFT: step 12, held-out loss 3.500" in report
    assert "reward model: step 6, held-out pairwise accuracy 0.750" in report
    assert "PPO: step 3, reward-model score -1.000, rule score 0.500, KL 0.250" in report
    assert "PPO final (after 3 steps)" in report


def test_every_stages_configuration_is_checked_before_any_stage_runs(tmp_path: Path) -> None:
    """A reward-model mistake used to surface after SFT had trained; each stage's settings are
    loaded up front, without a process group, and a refusal names its stage."""
    from megatron_rlhf.instructgpt import check_stage_configs

    ppo = check_stage_configs(tmp_path, [], ["steps=3"], ["train.max_steps=2"])
    assert ppo.steps == 3 and not (tmp_path / "sft").exists()
    for sft, rm, stage in [(["train.max_steps=-1"], [], "SFT"),
                           ([], ["train.max_steps=-1"], "reward-model")]:
        with pytest.raises(ValueError, match=f"^{stage} stage: train.max_steps=-1 must be >= 0"):
            check_stage_configs(tmp_path, [], [], sft, rm)
    with pytest.raises(ValueError, match=r"^PPO stage: .*unknown config key 'stepz'"):
        check_stage_configs(tmp_path, [], ["stepz=3"])
