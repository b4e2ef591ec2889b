"""The supervised rows of PPO-ptx: one pass shows every demonstration once, as a pure function
of the update number, padded to PPO's sequence length."""

from __future__ import annotations

import pytest

from megatron_rlhf.data import SFTExample, generate_records
from megatron_rlhf.data.demonstrations import DemonstrationStream
from megatron_rlhf.data.synthetic import SyntheticTaskConfig


def _examples(n: int) -> list[SFTExample]:
    records = generate_records(SyntheticTaskConfig(seed=1, num_train=n))
    return [SFTExample(record["prompt"], record["response"]) for record in records]


def test_demonstration_stream_covers_every_example_once_per_pass(tokenizer) -> None:
    stream = DemonstrationStream(_examples(12), tokenizer, length=40, rows=4, seed=3)
    first_pass = [stream.batch(update) for update in range(3)]
    rows = [tuple(row.tolist()) for batch in first_pass for row in batch["input_ids"]]
    assert len(set(rows)) == 12, "one pass shows each demonstration once"
    assert all(batch["input_ids"].shape == (4, 40) for batch in first_pass)
    again = DemonstrationStream(_examples(12), tokenizer, length=40, rows=4, seed=3)
    assert all(batch["input_ids"].equal(again.batch(u)["input_ids"])
               for u, batch in enumerate(first_pass)), "a pure function of the update number"
    second = {tuple(row.tolist()) for u in range(3, 6) for row in stream.batch(u)["input_ids"]}
    assert second == set(rows) and not stream.batch(3)["input_ids"].equal(first_pass[0][
        "input_ids"]), "the next pass is a new permutation of the same rows"
    batch = first_pass[0]
    assert (batch["loss_mask"] <= batch["attention_mask"]).all()
    assert int(batch["loss_mask"].sum()) > 0 and int(batch["loss_mask"][:, 0].sum()) == 0


def test_demonstration_stream_refuses_more_rows_than_demonstrations(tokenizer) -> None:
    with pytest.raises(ValueError, match=r"ptx.rows\(8\) exceeds the 5 demonstrations"):
        DemonstrationStream(_examples(5), tokenizer, length=40, rows=8, seed=0)


def test_demonstration_stream_refuses_a_prompt_that_fills_the_row(tokenizer) -> None:
    with pytest.raises(ValueError, match=r"leaves no room for a response in max_length\(4\)"):
        DemonstrationStream(_examples(5), tokenizer, length=4, rows=2, seed=0)
