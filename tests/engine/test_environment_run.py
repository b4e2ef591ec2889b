"""A user's environment (a module written to ``tmp_path``, outside the package) in whole GRPO runs
on 2 gloo ranks through ``run_ppo``: every reply is answered, episodes take several turns, the
step rewards join the score, the ``rollout/*`` metrics are logged, and a run saved after step 1
and resumed gives step 2's metrics bit for bit as the uninterrupted run; held-out evaluation
runs episodes too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import run_on_ranks

USER_MODULE = '''
class Counter:
    """Answers each reply with the replies left; each reply earns its length mod 3 / 10."""

    def __init__(self, record, replies=2):
        self.left = replies

    def reset(self):
        return None

    def step(self, response):
        self.left -= 1
        return f"{self.left} left", (len(response) % 3) / 10, self.left == 0
'''


def _config(root: Path, name: str, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
        f"run_dir={root / name}", "steps=2", "placement.strategy=interleaving",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.num_minibatches=1", "rollout.ppo_epochs=1", "generation.max_new_tokens=6",
        "rollout.environment={name: 'agent_env:Counter', kwargs: {replies: 2}}",
        "rollout.max_turns=3", "rollout.max_episode_tokens=32", *overrides])


def _runs(tmp_path: str, module_dir: str) -> dict:
    import sys

    from tests.helpers.runs import whole_and_resumed

    sys.path.insert(0, module_dir)
    return whole_and_resumed(_config, Path(tmp_path), "evaluation.num_prompts=4",
                             "evaluation.interval=0")


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_an_environment_runs_resumes_bit_exactly_and_scores(tmp_path: Path) -> None:
    (tmp_path / "agent_env.py").write_text(USER_MODULE)
    results = run_on_ranks(_runs, world_size=2, args=(str(tmp_path), str(tmp_path)),
                           timeout_s=340, env={"PYTHONPATH": str(tmp_path)})
    whole, resumed = results[0]["whole"], results[0]["resumed"]
    # held-out evaluation runs episodes too: before the first step and after the last
    assert [m["step"] for m in whole] == [0, 1, 2]
    for record in (whole[0], whole[2]):
        for mode in ("greedy", "sampled"):
            assert record[f"eval/{mode}/rollout/turns"] > 1
            assert record[f"eval/{mode}/rollout/environment_reward"] > 0
    train = [{k: v for k, v in m.items() if not k.startswith("eval/")} for m in whole[:2]]
    assert resumed[-1] == train[-1], "the resumed step 2 equals the uninterrupted one"
    for metrics in train:
        assert metrics["rollout/turns"] > 1 and metrics["rollout/observation_tokens"] > 0
        assert metrics["rollout/tool_calls"] == 0
        assert 0 < metrics["rollout/environment_reward"] <= 0.4
        assert metrics["reward_mean"] >= metrics["rollout/environment_reward"] - 1e-6
