"""The record's way to a reward function and the score's way back: readers keep every field,
the prompt stream hands out each step's records in its prompts' order, the engine's adapter
decodes rows for the functions, and ``compute_advantages`` weighs and logs their scores."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.algorithms import PPOAlgorithmConfig, RunningMoments, build_kl_controller
from megatron_rlhf.data import ReaderConfig, read_records
from megatron_rlhf.data.prompts import PromptStream
from megatron_rlhf.engine.execution import function_rewards
from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures
from megatron_rlhf.engine.execution.function_rewards import FunctionRewards, row_token_ids
from megatron_rlhf.engine.step.experience import compute_advantages
from megatron_rlhf.rewards import RewardFunctions, RewardFunctionSpec, parse_reward_functions
from megatron_rlhf.runtime.metric_reduce import Mean

ROWS = [{"prompt": "What is 6 * 7?", "answer": "42", "tests": ["assert f() == 42"], "id": 3},
        {"prompt": "Name a colour.", "answer": "red", "tests": [], "id": 4}]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_readers_keep_the_whole_record(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    else:
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    records, _ = read_records(path, ReaderConfig(required=["prompt"]))
    assert [record.row for record in records] == ROWS
    assert records[0].prompt == "What is 6 * 7?"


def test_the_prompt_stream_gives_each_steps_records_in_its_prompts_order() -> None:
    prompts = [[10 + i] for i in range(6)]
    records = [{"answer": str(10 + i)} for i in range(6)]
    stream = PromptStream(prompts, batch_size=2, seed=5, records=records)
    for step in range(5):  # across passes
        chosen, _ = stream.batch(step)
        assert [(index, record) for index, record in stream.batch_records(step)] == [
            (p[0] - 10, {"answer": str(p[0])}) for p in chosen]
    assert PromptStream(prompts, 2, 5).batch_records(0)[0][1] == {}
    with pytest.raises(ValueError, match="5 records for 6 prompts"):
        PromptStream(prompts, 2, 5, records=records[:5])


def test_function_rewards_decode_each_row_and_keep_extras() -> None:
    input_ids = torch.tensor([[0, 7, 8, 1, 2, 0], [5, 6, 8, 3, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert row_token_ids(input_ids, mask, 3) == [([7, 8], [1, 2]), ([5, 6, 8], [3])]
    words = {1: "it", 2: "42", 3: "red", 5: "name", 6: "a", 7: "six", 8: "times"}
    rewards = FunctionRewards(RewardFunctions(parse_reward_functions([
        {"name": "tests.rewards.user_functions:answer_in_response"},
        {"name": "tests.rewards.user_functions:graded"}])),
        lambda ids: " ".join(words[i] for i in ids))
    try:
        found = rewards.score(input_ids, mask, 3, [(0, ROWS[0]), (1, ROWS[1])],
                              keep_extras=True)
    finally:
        rewards.close()
    torch.testing.assert_close(found["function_scores"], torch.tensor([[1.0, 0.5], [1.0, 0.5]]))
    torch.testing.assert_close(found["reward_errors"], torch.tensor([0.0, 0.0]))
    # graded logs len(response): "it 42" and "red"
    assert rewards.take_extras() == {"reward/graded/length": Mean(8.0, 2.0)}
    assert rewards.take_extras() == {}


def test_compute_advantages_weighs_function_scores_beside_the_model_and_the_rule() -> None:
    mask = torch.ones(4, 3, dtype=torch.long)
    logprobs = -torch.ones(4, 3)
    fields = {"old_logprobs": logprobs, "ref_logprobs": logprobs.clone(), "response_mask": mask,
              "rm_scores": torch.tensor([1.0, 2.0, 3.0, 4.0]),
              "rule_scores": torch.tensor([0.0, 1.0, 0.0, 1.0]),
              "function_scores": torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]),
              "reward_errors": torch.tensor([0.0, 1.0, 0.0, 2.0])}
    config = PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss",
                                grpo_std_normalize=False)
    specs = [RewardFunctionSpec("m:correct", 2.0), RewardFunctionSpec("m:formatted", -1.0)]
    out, metrics = compute_advantages(fields, config, build_kl_controller(config),
                                      RunningMoments(), 0.5, 3.0, samples_per_prompt=2,
                                      functions=specs, features=ExperienceFeatures(
                                          reward_model=True, functions=True))
    # 0.5 * rm + 3 * rule + 2 * correct - formatted: [2.5, 4.0, 2.5, 4.0]
    assert metrics["reward_mean"] == pytest.approx(3.25)
    assert metrics["reward/correct"] == pytest.approx(0.5)
    assert metrics["reward/formatted"] == pytest.approx(0.5)
    assert metrics["reward/errors"] == 3.0
    # group means 3.25 and 3.25: advantages -0.75, 0.75, -0.75, 0.75 on every token
    torch.testing.assert_close(out["advantages"][:, 0], torch.tensor([-0.75, 0.75, -0.75, 0.75]))


def test_a_function_failing_on_most_rows_under_on_error_zero_is_warned_about(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """12 of 16 rows without the ``answer`` the function reads: one warning for the step, with
    the share and the first failure; the next step inside the rate limit is counted, not
    warned about; a step at or under the share is quiet."""
    input_ids = torch.tensor([[5, 1, 2]] * 16)
    mask = torch.ones(16, 3, dtype=torch.long)
    words = {1: "it", 2: "42", 5: "q"}
    rewards = FunctionRewards(RewardFunctions(parse_reward_functions([
        {"name": "tests.rewards.user_functions:answer_in_response"}]), on_error="zero"),
        lambda ids: " ".join(words[i] for i in ids))
    records = [(i, {"answer": "42"} if i < 4 else {"prompt": "q"}) for i in range(16)]
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    log = logging.getLogger("megatron_rlhf.engine.execution.function_rewards")
    log.addHandler(handler)
    clock = [0.0]
    monkeypatch.setattr(function_rewards, "monotonic", lambda: clock[0])

    def warn_at(now: float, what: str) -> str | None:
        clock[0] = now
        return rewards.warn_failures(what)

    try:
        rewards.score(input_ids[:8], mask[:8], 1, records[:8], keep_extras=True)
        rewards.score(input_ids[8:], mask[8:], 1, records[8:], keep_extras=True)
        first = warn_at(1000.0, "step 3")
        rewards.score(input_ids, mask, 1, records, keep_extras=True)
        second = warn_at(1010.0, "step 4")
        rewards.score(input_ids[:5], mask[:5], 1, records[:5], keep_extras=True)  # 1 of 5
        quiet = warn_at(2000.0, "step 5")
        rewards.score(input_ids, mask, 1, records, keep_extras=True)
        third = warn_at(2000.0, "step 6")
    finally:
        rewards.close()
        log.removeHandler(handler)
    assert first is not None
    assert first.startswith("reward functions failed on 12 of the 16 rows this rank scored in "
                            "step 3 (75%, above 25%); reward.on_error=zero scores those calls 0")
    assert ("The first: reward function 'tests.rewards.user_functions:answer_in_response' "
            "raised KeyError: \"the record has no 'answer': ['prompt']\" on prompt record #4 "
            '({"prompt": "q"}).') in first
    assert [record.getMessage() for record in seen] == [first, third]
    assert seen[0].levelno == logging.WARNING and seen[0].any_rank
    assert second is None and quiet is None
    assert third is not None and "in step 6 (75%, above 25%) (1 more step(s) above" in third


def test_prompts_reader_can_require_a_field_reward_functions_read(tmp_path: Path) -> None:
    """``prompts.reader.required=[prompt, answer]``: every record is checked for the answer when
    the files are read (plain and conversation records), and errors name prompts.reader."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.data import DataError

    reader = load_config(RunConfig, None,
                         ["prompts.reader.required=[prompt, answer]"]).prompts.reader
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [
        {"prompt": "What is 6 * 7?", "answer": "42"}, {"prompt": "What is 1 + 1?"},
        {"prompt": "What is 2 + 2?", "answer": " "},
        {"messages": [{"role": "user", "content": "hi"}], "answer": "x"}]))
    records, summary = read_records(path, reader)
    assert [record.row.get("answer") for record in records] == ["42", "x"]
    assert summary.counts == {"missing_field": 1, "empty_text": 1}
    assert ("line 2, field 'answer': missing_field (no 'answer': key absent or null "
            "(prompts.reader.required))") in summary.format()
    with pytest.raises(DataError, match=r"line 2, field 'answer'.*set prompts.reader."
                                         r"on_bad_record=skip"):
        read_records(path, replace(reader, on_bad_record="error"))
    with pytest.raises(ValueError, match=r"^prompts.reader.required=\['answer'\] must include "
                                         r"'prompt'"):
        load_config(RunConfig, None, ["prompts.reader.required=[answer]"])
    with pytest.raises(ValueError, match=r"^prompts.reader.on_bad_record='x' must be one of"):
        load_config(RunConfig, None, ["prompts.reader.on_bad_record=x"])
