"""``rollout.max_episode_tokens: auto``, the default: a multi-turn config that does not set it
loads with room for every reply and an answer as long as a prompt between two replies, records
the number in its YAML, and a GRPO run against an environment (2 gloo ranks, one step) takes
every turn within that budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import run_on_ranks

ENVIRONMENT = "rollout.environment={name: 'tests.rewards.user_envs:Countdown', kwargs: {replies: 3}}"


def _config(run_dir: str, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
        f"run_dir={run_dir}", "steps=1", "placement.strategy=interleaving",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.num_minibatches=1",
        "rollout.max_turns=3", "rollout.max_prompt_length=16", "generation.max_new_tokens=6",
        *overrides])


def test_a_multi_turn_config_without_a_budget_gets_the_documented_one(tmp_path: Path) -> None:
    from megatron_rlhf.config.loader import load_config, to_yaml
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.stage_memory import decode_positions

    config = _config(str(tmp_path), ENVIRONMENT)
    assert config.rollout.max_episode_tokens == 3 * 6 + 2 * 16
    assert decode_positions(config) == 16 + 50
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    assert load_config(RunConfig, tmp_path / "config.yaml").rollout.max_episode_tokens == 50
    assert _config(str(tmp_path), ENVIRONMENT, "rollout.max_turns=2",
                   "rollout.max_prompt_length=20").rollout.max_episode_tokens == 2 * 6 + 20
    assert _config(str(tmp_path), ENVIRONMENT,
                   "rollout.max_episode_tokens=24").rollout.max_episode_tokens == 24
    single = _config(str(tmp_path), "rollout.max_turns=1")
    assert single.rollout.max_episode_tokens == "auto" and decode_positions(single) == 16 + 6
    with pytest.raises(ValueError, match=r"rollout.max_episode_tokens=0: with rollout.tools"):
        _config(str(tmp_path), ENVIRONMENT, "rollout.max_episode_tokens=0")
    with pytest.raises(ValueError, match=r"rollout.max_episode_tokens='many' must be 'auto'"):
        _config(str(tmp_path), ENVIRONMENT, "rollout.max_episode_tokens=many")


def _run(root: str) -> tuple[int, int, list[dict]]:
    from megatron_rlhf.engine.run import runner
    from tests.helpers.metrics import run_metrics
    from tests.helpers.runs import capture_engine

    captured = capture_engine()
    runner.run_ppo(_config(root, ENVIRONMENT))
    engine = captured["engine"]
    return (engine.generation.max_new_tokens, engine.episodes.config.max_episode_tokens,
            run_metrics(Path(root)))  # written by rank 0


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_run_without_a_budget_takes_every_turn(tmp_path: Path) -> None:
    width, budget, metrics = run_on_ranks(_run, world_size=2, args=(str(tmp_path),),
                                          timeout_s=240)[0]
    metrics = metrics[-1]
    assert width == budget == 50  # the rows' response width is the episode's budget
    assert metrics["rollout/turns"] == 3.0 and metrics["rollout/truncated"] == 0.0, metrics
    assert metrics["rollout/observation_tokens"] > 0
