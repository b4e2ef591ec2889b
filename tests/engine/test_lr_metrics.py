"""Every PPO step logs the learning rate each trained model's updates ran at (``actor/lr``,
``critic/lr``): the schedule's value, and after a resume with a new ``lr`` the new one."""

from __future__ import annotations

import json
from pathlib import Path

from tools import run_ppo as run_ppo_tool

_SMALL = ["--placement", "flattening", "rollout.prompts_per_step=8", "rollout.ppo_epochs=1",
          "rollout.num_minibatches=1", "generation.max_new_tokens=4"]


def test_each_step_logs_the_scheduled_learning_rate_also_after_a_resume_with_a_new_one(
        tmp_path: Path) -> None:
    save_dir, run_dir = tmp_path / "ck", tmp_path / "run"
    common = ["--save-dir", str(save_dir), "--run-dir", str(run_dir), *_SMALL,
              "actor_optimizer.lr_warmup_steps=4", "critic_optimizer.lr=2e-3"]
    assert run_ppo_tool.main(["--steps", "2", *common, "actor_optimizer.lr=4e-4"]) == 0
    assert run_ppo_tool.main(["--steps", "3", "--resume", *common,
                              "actor_optimizer.lr=8e-4"]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # linear warm-up over 4 updates from 0: update k runs at lr * k / 4, the resumed one at the
    # new lr's point of the warm-up
    assert [m["actor/lr"] for m in metrics] == [0.0, 1e-4, 4e-4]
    assert [m["critic/lr"] for m in metrics] == [2e-3] * 3
