"""The synthetic task: rule bounds and values, preference order, determinism, public schema."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.data import ReaderConfig, read_records
from megatron_rlhf.data.synthetic import (
    FILLER_WORDS,
    PROMPT_TEMPLATES,
    RULE_MAX_REPEATS,
    RULE_MIN_WORDS,
    TOPICS,
    SyntheticTaskConfig,
    generate_records,
    main,
    rule_score,
    topic_of,
    write_task_jsonl,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = SyntheticTaskConfig(seed=5, num_train=600, num_test=50)


def test_every_pair_prefers_chosen_by_the_rule() -> None:
    records = generate_records(CONFIG) + generate_records(CONFIG, "test")
    for record in records:
        assert set(record) == {"prompt", "response", "chosen", "rejected"}
        assert record["response"] == record["chosen"]
        assert topic_of(record["prompt"]) in TOPICS
        assert rule_score(record["prompt"], record["chosen"]) > rule_score(
            record["prompt"], record["rejected"]
        )


def test_scores_leave_headroom_for_ppo() -> None:
    records = generate_records(CONFIG)
    chosen = [rule_score(r["prompt"], r["chosen"]) for r in records]
    rejected = [rule_score(r["prompt"], r["rejected"]) for r in records]
    assert 0.5 < sum(chosen) / len(chosen) < 0.8
    assert 0.2 < sum(rejected) / len(rejected) < 0.45
    assert {topic_of(r["prompt"]) for r in records} == set(TOPICS)


def test_rule_values() -> None:
    prompt = "Write about the ocean:"
    assert rule_score(prompt, "wave tide shell reef fish boat sand coral.") == 1.0
    assert rule_score(prompt, "Wave, TIDE! shell reef fish boat sand coral whale shore") == 1.0
    assert rule_score(prompt, "wave tide shell reef pan oven star moon.") == 0.5
    assert rule_score(prompt, "wave tide") == 2 / RULE_MIN_WORDS
    assert rule_score(prompt, " ".join(["wave"] * 8)) == RULE_MAX_REPEATS / 8
    assert rule_score(prompt, "wave wave wave tide tide tide shell shell") == 6 / 8
    assert rule_score(prompt, "") == 0.0
    assert rule_score(prompt, "tree moss leaf bark fern pine owl deer") == 0.0
    assert rule_score("Topic: forest. Answer:", "tree moss leaf bark fern pine owl deer") == 1.0
    assert rule_score("Say anything:", "wave tide shell reef fish boat sand coral") == 0.0


def test_rule_is_bounded_on_random_text() -> None:
    rng = random.Random(0)
    vocabulary = [w for words in TOPICS.values() for w in words] + list(FILLER_WORDS) + ["#", "42"]
    for _ in range(500):
        prompt = rng.choice(PROMPT_TEMPLATES).format(
            topic=rng.choice(sorted(TOPICS)), hint1="x", hint2="y"
        )
        response = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(0, 30)))
        assert 0.0 <= rule_score(prompt, response) <= 1.0


def test_generation_is_deterministic_by_seed(tmp_path: Path) -> None:
    assert generate_records(CONFIG) == generate_records(CONFIG)
    other = SyntheticTaskConfig(seed=6, num_train=600, num_test=50)
    assert generate_records(other) != generate_records(CONFIG)
    assert generate_records(CONFIG, "test") != generate_records(CONFIG)[:50]
    first = write_task_jsonl(tmp_path / "a", CONFIG)
    second = write_task_jsonl(tmp_path / "b", CONFIG)
    for split in ("train", "test"):
        assert first[split].read_bytes() == second[split].read_bytes()


def test_written_files_load_with_the_public_readers(tmp_path: Path) -> None:
    paths = write_task_jsonl(tmp_path, CONFIG)
    records, summary = read_records(paths["test"], ReaderConfig(on_bad_record="error"))
    assert summary.num_kept == 50
    lines = paths["test"].read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == [r.prompt for r in records]


def test_command_line_writes_files(tmp_path: Path) -> None:
    main([str(tmp_path), "--seed", "5", "--num-train", "600", "--num-test", "50"])
    assert (tmp_path / "train.jsonl").read_bytes() == write_task_jsonl(tmp_path / "api", CONFIG)[
        "train"
    ].read_bytes()
    main([str(tmp_path / "edits"), "--seed", "5", "--num-train", "600", "--num-test", "0",
          "--contrast-fraction", "0.8", "--distinct-topic-words", "--over-cap-edits",
          "--min-response-words", "4"])
    edits = SyntheticTaskConfig(seed=5, num_train=600, num_test=0, contrast_fraction=0.8,
                                distinct_topic_words=True, over_cap_edits=True,
                                min_response_words=4)
    assert (tmp_path / "edits" / "train.jsonl").read_bytes() == write_task_jsonl(
        tmp_path / "edits_api", edits)["train"].read_bytes()


def test_command_line_refuses_bad_sizes_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--min-response-words", "0"])
    assert exit_info.value.code == 2
    assert "min_response_words(0)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_topic_vocabularies_do_not_overlap() -> None:
    words = [w for topic_words in TOPICS.values() for w in topic_words]
    assert len(words) == len(set(words))
    assert not set(words) & set(FILLER_WORDS)
    assert not set(TOPICS) & (set(words) | set(FILLER_WORDS))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_train": -1}, "num_train"),
        ({"min_response_words": 0}, "min_response_words"),
        ({"min_response_words": 9, "max_response_words": 8}, "max_response_words"),
    ],
)
def test_config_validation(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticTaskConfig(**kwargs)


def test_contrast_pairs_cover_each_part_of_the_rule() -> None:
    config = SyntheticTaskConfig(seed=5, num_train=400, num_test=0, contrast_fraction=1.0)
    records = generate_records(config)
    for record in records:
        assert rule_score(record["prompt"], record["chosen"]) > rule_score(
            record["prompt"], record["rejected"]
        )
    lengths = [(len(r["chosen"].split()), len(r["rejected"].split())) for r in records]
    # Cut answers (shorter than the rule's floor) and padded ones (longer) both lose.
    assert sum(rejected < RULE_MIN_WORDS for _, rejected in lengths) > 40
    assert sum(rejected > chosen for chosen, rejected in lengths) > 40
    over_repeated = [r for r in records if max(
        r["rejected"].rstrip(".").split().count(w) for w in TOPICS[topic_of(r["prompt"])]
    ) > RULE_MAX_REPEATS + 2]
    assert len(over_repeated) > 40
    swapped = [r for r in records if rule_score(r["prompt"], r["rejected"]) == 0.0]
    assert len(swapped) > 40


def test_contrast_fraction_must_be_a_share() -> None:
    with pytest.raises(ValueError, match="contrast_fraction"):
        SyntheticTaskConfig(contrast_fraction=1.5)


def test_distinct_topic_words_never_teach_a_loop() -> None:
    config = SyntheticTaskConfig(seed=5, num_train=600, num_test=0, contrast_fraction=0.8,
                                 distinct_topic_words=True)
    records = generate_records(config)
    loops_rejected = 0
    for record in records:
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        assert rule_score(prompt, chosen) > rule_score(prompt, rejected)
        topic_words = TOPICS[topic_of(prompt)]
        words = chosen.rstrip(".").split()
        counts = [words.count(w) for w in topic_words]
        # What SFT imitates repeats no topic word before it has used all twelve.
        assert max(counts) <= 1 or min(counts) >= 1, chosen
        rejected_words = rejected.rstrip(".").split()
        if (len(rejected_words) >= RULE_MIN_WORDS and set(rejected_words) <= set(topic_words)
                and len(set(rejected_words)) <= 2):
            # A loop of one or two topic words, against a varied answer of its own length.
            loops_rejected += 1
            assert len(rejected_words) == len(words)
            assert len(set(words) & set(topic_words)) > len(set(rejected_words))
    assert loops_rejected > 40
    # Without the option the stream is the original one, byte for byte.
    plain = SyntheticTaskConfig(seed=5, num_train=600, num_test=0, contrast_fraction=0.8)
    assert generate_records(plain) != records
    assert generate_records(plain) == generate_records(
        SyntheticTaskConfig(seed=5, num_train=600, num_test=0, contrast_fraction=0.8,
                            distinct_topic_words=False))


def _topic_word_counts(text: str, topic: str) -> Counter:
    return Counter(word for word in text.rstrip(".").split() if word in TOPICS[topic])


def test_over_cap_edits_differ_from_their_answer_only_by_the_repeat_cap() -> None:
    base = dict(seed=5, num_train=600, num_test=0, contrast_fraction=0.8,
                distinct_topic_words=True)
    records = generate_records(SyntheticTaskConfig(**base, over_cap_edits=True))
    over_cap = 0
    for record in records:
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        assert rule_score(prompt, chosen) > rule_score(prompt, rejected)
        topic = topic_of(prompt)
        chosen_words, rejected_words = chosen.rstrip(".").split(), rejected.rstrip(".").split()
        chosen_counts = _topic_word_counts(chosen, topic)
        rejected_counts = _topic_word_counts(rejected, topic)
        if (len(chosen_words) == len(rejected_words)
                and sum(chosen_counts.values()) == sum(rejected_counts.values())
                and max(rejected_counts.values(), default=0) > RULE_MAX_REPEATS
                and len(rejected_counts) > 2):
            over_cap += 1
            # Words off the topic are where they were; only topic words were overwritten.
            assert all(c == r for c, r in zip(chosen_words, rejected_words, strict=True)
                       if c not in TOPICS[topic])
    # One contrast edit in six, of the 80% contrast pairs (loops and repeat edits excluded).
    assert 40 < over_cap < 140
    assert generate_records(SyntheticTaskConfig(**base)) == generate_records(
        SyntheticTaskConfig(**base, over_cap_edits=False))


def test_a_quarter_of_the_pipelines_sft_answers_fall_under_the_rules_floor() -> None:
    """examples/ppo_pipeline.yaml draws answers of 4 to 16 words, so SFT sees short answers and its
    greedy answers stop early, which PPO can mend (docs/results/main-job-history.md); the pairs stay ordered by
    the rule and the answers SFT imitates still never loop."""
    pipeline = load_config(RunConfig, EXAMPLES / "ppo_pipeline.yaml").prompts.synthetic
    config = dataclasses.replace(pipeline, num_train=3000, num_test=0)
    records = generate_records(config)
    lengths = [len(r["response"].rstrip(".").split()) for r in records]
    assert config.min_response_words < RULE_MIN_WORDS
    assert max(lengths) == config.max_response_words
    under_floor = sum(n < RULE_MIN_WORDS for n in lengths) / len(lengths)
    assert 0.15 < under_floor < 0.4, under_floor
    for record in records:
        prompt, chosen = record["prompt"], record["chosen"]
        assert rule_score(prompt, chosen) > rule_score(prompt, record["rejected"])
        counts = _topic_word_counts(chosen, topic_of(prompt))
        assert max(counts.values(), default=0) <= 1 or len(counts) == len(TOPICS[topic_of(prompt)])
