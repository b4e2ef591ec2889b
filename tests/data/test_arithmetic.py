"""The shipped arithmetic task: its files are what the generator writes, the splits are disjoint
and correct, the ordinary JSONL reader reads them as the example configurations name the fields,
and those configurations load and plan on one CPU rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.config.supervised_run import SFTConfig
from megatron_rlhf.data import read_files
from megatron_rlhf.data.arithmetic import (
    SPLITS,
    ArithmeticTaskConfig,
    arithmetic_splits,
    write_arithmetic_task,
)
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.rewards.verifiers import math_reward
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_shipped_files_are_the_generators_output(tmp_path: Path) -> None:
    written = write_arithmetic_task(tmp_path, ArithmeticTaskConfig())
    for name, path in written.items():
        assert (EXAMPLES / "arithmetic" / path.name).read_text() == path.read_text(), name


def test_the_splits_are_disjoint_sums_covering_every_question() -> None:
    splits = arithmetic_splits(ArithmeticTaskConfig(low=10, high=99, demonstrations=5,
                                                    held_out=7, seed=3))
    assert [len(splits[s]) for s in SPLITS] == [5, 90 * 90 - 12, 7]
    questions = [r["question"] for s in SPLITS for r in splits[s]]
    assert len(set(questions)) == len(questions) == 90 * 90
    for record in splits["test"]:
        a, b = (int(x) for x in record["question"][len("What is "):-1].split(" + "))
        assert int(record["answer"]) == a + b
    assert "What is 37 + 48?" in questions
    assert arithmetic_splits(ArithmeticTaskConfig(seed=3)) != arithmetic_splits(
        ArithmeticTaskConfig(seed=4))


@pytest.mark.parametrize(("changes", "message"), [
    ({"low": 5, "high": 4}, r"low=5 and high=4"),
    ({"demonstrations": 0}, r"demonstrations=0"),
    ({"high": 9, "demonstrations": 50, "held_out": 50},
     r"leave GRPO some of the 100 questions"),
])
def test_bad_task_settings_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArithmeticTaskConfig(**changes)


def test_the_reader_reads_the_records_as_the_examples_name_the_fields() -> None:
    sft = load_config(SFTConfig, EXAMPLES / "sft_arithmetic.yaml")
    grpo = load_config(RunConfig, EXAMPLES / "grpo_arithmetic.yaml")
    demonstrations, _ = read_files(sft.data.paths, sft.data.reader)
    shipped = [json.loads(line) for line in
               (EXAMPLES / "arithmetic" / "sft.jsonl").read_text().splitlines()]
    assert [(r.prompt, r.response) for r in demonstrations] == [
        (r["question"], r["answer"]) for r in shipped]
    prompts, _ = read_files(grpo.prompts.paths, grpo.prompts.reader)
    task = ArithmeticTaskConfig()
    questions = (task.high - task.low + 1) ** 2
    assert len(prompts) == questions - task.demonstrations - task.held_out
    assert all(r.row["answer"] for r in prompts)
    # The reward the run gives: the record's answer, through the math verifier.
    record = prompts[0].row
    assert math_reward(prompts[0].prompt, f" {record['answer']}", record) == 1.0
    assert math_reward(prompts[0].prompt, f" {int(record['answer']) + 1}", record) == 0.0


def test_the_grpo_example_plans_on_one_rank() -> None:
    config = load_config(RunConfig, EXAMPLES / "grpo_arithmetic.yaml")
    assert config.reward.model_weight == 0 and [f["name"] for f in config.reward.functions] == [
        "megatron_rlhf.rewards.verifiers:math_reward"]
    assert config.evaluation.num_prompts == ArithmeticTaskConfig().held_out
    plan = make_plan(config, ClusterSpec((DevicePool("cpu", nodes=1, devices_per_node=1),)))
    assert set(plan.roles) == {"actor", "ref"}, "GRPO at reward weight 0: no critic, no reward"
