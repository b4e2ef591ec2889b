"""The calculator task (examples/calculator): its user module, its files, and a run of both
stages through ``tools/run_arithmetic.py --task calculator``, the tool on ``PYTHONPATH`` as a
user's module outside the package is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, tool_command, tool_env

TASK = REPO / "examples" / "calculator"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TASK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_tool_multiplies_and_the_verifier_reads_the_last_reply_only() -> None:
    tools = _load("calculator_tools")
    assert tools.calculator({"a": 347, "b": "821", "op": "*"}, {}) == str(347 * 821)
    with pytest.raises(KeyError):
        tools.calculator({"a": 1, "b": 2, "op": "/"}, {})
    record = {"answer": "284887"}
    answered = "<tool_call>...</tool_call>\n<tool_response>\n284887\n</tool_response>\n"
    assert tools.final_answer_reward("q", answered + " 284887", record) == 1.0
    assert tools.final_answer_reward("q", answered + " 284888", record) == 0.0
    assert tools.final_answer_reward("q", answered, record) == 0.0  # the tool's answer alone
    assert tools.final_answer_reward("q", " 284887", record) == 1.0  # no tool: the whole reply


def test_the_shipped_files_are_what_make_task_writes(tmp_path: Path, monkeypatch) -> None:
    make_task = _load("make_task")
    monkeypatch.setattr(make_task, "__file__", str(tmp_path / "make_task.py"))
    make_task.main()
    for written in sorted(tmp_path.iterdir()):
        assert written.read_text() == (TASK / written.name).read_text(), written.name
    splits = {name: [json.loads(line) for line in (TASK / f"{name}.jsonl").open()]
              for name in ("sft_tools", "train", "test")}
    questions = {name: {r["question"] for r in rows} for name, rows in splits.items()}
    assert not (questions["sft_tools"] & questions["train"] or questions["sft_tools"]
                & questions["test"] or questions["train"] & questions["test"])
    demo = splits["sft_tools"][0]
    assert [turn["role"] for turn in demo["turns"]] == ["assistant", "tool", "assistant"]
    assert demo["turns"][1]["content"] == demo["turns"][2]["content"] == demo["answer"]


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_sft_then_grpo_with_the_calculator_runs(tmp_path: Path) -> None:
    command = tool_command("run_arithmetic.py", [
        "--task", "calculator", "--run-dir", str(tmp_path), "--sft-set", "train.epochs=3",
        "steps=1", "evaluation.num_prompts=8", "rollout.prompts_per_step=2",
        # one worker process each for the tool and the answer reward (2 by default): a spawned
        # worker's start-up is most of this small run's time
        "rollout.tool_workers=1", "reward.workers=1"], nproc=1)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180,
                            env=tool_env(PYTHONPATH=f"{REPO}:{TASK}"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").open()]
    step = next(r for r in records if "reward_mean" in r)
    assert step["rollout/tool_calls"] > 0 and step["rollout/observation_tokens"] > 0
    assert "eval/greedy/reward/final_answer_reward" in records[0]
    assert "held-out exact-match accuracy" in result.stdout
