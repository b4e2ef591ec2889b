"""Splits: disjoint, covering, close to the fractions, stable under added records and reordering."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_rlhf.data import (
    DataConfig,
    PreferenceRecord,
    SplitConfig,
    SyntheticTaskConfig,
    load_splits,
    portion_of,
    split_records,
    write_task_jsonl,
)


def _records(count: int, tag: str = "") -> list[PreferenceRecord]:
    return [PreferenceRecord(prompt=f"prompt {tag}{i}", response=f"r{i}") for i in range(count)]


def _portions(records: list[PreferenceRecord], config: SplitConfig) -> dict[str, str]:
    splits = split_records(records, config)
    return {r.prompt: name for name in ("sft", "rm", "ppo") for r in getattr(splits, name)}


def test_portions_are_disjoint_and_cover_in_input_order() -> None:
    records = _records(3000)
    splits = split_records(records, SplitConfig(sft=0.5, rm=0.3, ppo=0.2))
    parts = [splits.sft, splits.rm, splits.ppo]
    ids = [id(r) for part in parts for r in part]
    assert len(ids) == len(set(ids)) == len(records)
    assert set(ids) == {id(r) for r in records}
    for part in parts:
        positions = [records.index(r) for r in part[:50]]
        assert positions == sorted(positions)
    sizes = splits.sizes()
    assert abs(sizes["sft"] / 3000 - 0.5) < 0.04
    assert abs(sizes["rm"] / 3000 - 0.3) < 0.04
    assert abs(sizes["ppo"] / 3000 - 0.2) < 0.04


def test_adding_and_shuffling_records_moves_no_one() -> None:
    config = SplitConfig(seed=7)
    old = _records(500)
    before = _portions(old, config)
    grown = old + _records(300, tag="new ")
    random.Random(0).shuffle(grown)
    after = _portions(grown, config)
    assert all(after[prompt] == portion for prompt, portion in before.items())


def test_same_prompt_same_portion_and_seed_matters() -> None:
    config = SplitConfig()
    twins = [
        PreferenceRecord("shared prompt", response="a"),
        PreferenceRecord("shared prompt", response="b"),
    ]
    assert len({portion_of(r.prompt, config) for r in twins}) == 1
    records = _records(400)
    assert _portions(records, SplitConfig(seed=0)) != _portions(records, SplitConfig(seed=1))
    assert _portions(records, SplitConfig(seed=1)) == _portions(records, SplitConfig(seed=1))


@pytest.mark.parametrize(("sft", "rm", "ppo"), [(1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.5, 0.0)])
def test_zero_fractions_get_nothing(sft: float, rm: float, ppo: float) -> None:
    sizes = split_records(_records(500), SplitConfig(sft=sft, rm=rm, ppo=ppo)).sizes()
    for name, fraction in {"sft": sft, "rm": rm, "ppo": ppo}.items():
        assert (sizes[name] == 0) == (fraction == 0)


def test_fractions_summing_slightly_under_one_lose_no_record() -> None:
    config = SplitConfig(sft=0.3333333, rm=0.3333333, ppo=0.3333333)
    assert sum(split_records(_records(2000), config).sizes().values()) == 2000


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"sft": 0.5, "rm": 0.5, "ppo": 0.5}, "sum to 1"),
        ({"sft": 1.2, "rm": -0.2, "ppo": 0.0}, ">= 0"),
    ],
)
def test_split_config_validation(kwargs: dict[str, float], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        SplitConfig(**kwargs)


def test_load_splits_end_to_end(tmp_path: Path) -> None:
    paths = write_task_jsonl(tmp_path, SyntheticTaskConfig(seed=2, num_train=300, num_test=0))
    splits, summaries = load_splits(DataConfig(paths=[str(paths["train"])]))
    assert sum(splits.sizes().values()) == 300 and summaries[0].num_bad == 0
    assert min(splits.sizes().values()) > 40
    with pytest.raises(ValueError, match="paths is empty"):
        DataConfig()


def test_too_few_prompts_says_how_many_to_add_or_the_largest_prompts_per_step(
        tmp_path: Path) -> None:
    """With the whole file PPO's (``prompts.split.ppo=1``) the fix is more prompts or fewer per
    step, with the numbers; the split is named only when it holds prompts back."""
    import json

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.inputs import load_prompts
    from megatron_rlhf.models.tokenizer import load_tokenizer

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n"
                            for i in range(10)))
    config = load_config(RunConfig, Path("examples/ppo_tiny.yaml"),
                         [f"prompts.paths=[{data}]", "rollout.prompts_per_step=16"])
    with pytest.raises(ValueError) as refusal:
        load_prompts(config, load_tokenizer(config.tokenizer))
    assert str(refusal.value) == (
        "rollout.prompts_per_step(16) exceeds the 10 prompts available (the good records of "
        "prompts.paths); add at least 6 prompts or set rollout.prompts_per_step <= 10")
