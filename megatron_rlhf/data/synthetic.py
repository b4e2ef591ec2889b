"""The shipped synthetic learning task: "stay on the prompt's topic".

Every prompt names one of eight topics (ocean, forest, kitchen, ...), each with twelve topic words.
The hidden rule rewards a response by the share of its words that belong to the prompt's topic:

    rule_score = on_topic_words / max(num_words, RULE_MIN_WORDS)

where each distinct topic word counts at most ``RULE_MAX_REPEATS`` times, so repeating one word
does not pay and a high score needs several different topic words. The rule is computed on DECODED
TEXT (lower-cased ``[a-z]+`` words), so it does not depend on the tokenizer and serves directly as
a Python-callable rule reward. It is smooth (one word moves it by at most 1/8), bounded in [0, 1],
and needs the prompt: another topic's words score zero. Short answers are penalised because the
denominator is at least ``RULE_MIN_WORDS``.

Reference responses mix topic words, neutral filler and other topics' words at a random on-topic
rate, so their rule scores spread over [0, 1] and reinforcement learning has room above a
fine-tuned model (docs/results/main-job.md: the pipeline's sampled held-out answers 0.44-0.51 after
SFT, 0.65-0.71 after PPO).
With ``contrast_fraction`` a share of the pairs instead set a response against an edit of itself
that breaks one part of the rule, and ``distinct_topic_words`` keeps loops out of the answers SFT
imitates (docs/data.md).

Write the task as JSONL in the public preference schema (prompt/response/chosen/rejected, with
``response == chosen`` as in Dahoas/rm-static)::

    python -m megatron_rlhf.data.synthetic OUT_DIR [--seed 0] [--num-train N]
        [--contrast-fraction 0.8 --distinct-topic-words --over-cap-edits --min-response-words 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.runtime.logging import get_logger, setup_logging

logger = get_logger(__name__)

RULE_MIN_WORDS = 8
"""Denominator floor of the rule: a response needs at least this many words to reach 1.0."""
RULE_MAX_REPEATS = 2
"""Occurrences of one topic word that count as on topic; further repeats count as off topic."""

# fmt: off
TOPICS: dict[str, tuple[str, ...]] = {
    "ocean": ("wave", "tide", "shell", "reef", "fish", "boat", "sand", "coral", "whale", "shore",
              "foam", "crab"),
    "forest": ("tree", "moss", "leaf", "bark", "fern", "pine", "owl", "deer", "root", "trail",
               "branch", "acorn"),
    "kitchen": ("pan", "spoon", "bread", "oven", "knife", "soup", "plate", "flour", "butter",
                "kettle", "bowl", "sugar"),
    "space": ("star", "orbit", "moon", "comet", "rocket", "planet", "galaxy", "crater", "meteor",
              "sun", "probe", "nebula"),
    "music": ("drum", "song", "piano", "violin", "melody", "rhythm", "chord", "guitar", "flute",
              "tempo", "choir", "bass"),
    "city": ("road", "tower", "bus", "train", "street", "bridge", "subway", "taxi", "market",
             "park", "office", "traffic"),
    "farm": ("barn", "wheat", "cow", "tractor", "hay", "goat", "field", "corn", "pig", "sheep",
             "fence", "plow"),
    "weather": ("rain", "cloud", "storm", "snow", "wind", "thunder", "fog", "frost", "breeze",
                "hail", "drizzle", "sunshine"),
}

FILLER_WORDS: tuple[str, ...] = (
    "the", "a", "and", "very", "with", "some", "many", "is", "of", "in", "bright", "quiet", "old",
    "new", "small", "big", "soft", "warm", "cold", "good", "more", "then", "again", "really",
)

PROMPT_TEMPLATES: tuple[str, ...] = (
    "Write about the {topic}:",
    "Tell me something about the {topic}.",
    "Describe the {topic} in a few words:",
    "List words about the {topic}, like {hint1} and {hint2}:",
    "Topic: {topic}. Answer:",
    "What do you think of when you hear {topic}? Words like {hint1}:",
)
# fmt: on

_WORD_RE = re.compile(r"[a-z]+")
_TOPIC_WORDS = {topic: frozenset(words) for topic, words in TOPICS.items()}


def _words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


def topic_of(prompt_text: str) -> str | None:
    """Return the first topic name that appears as a word of the prompt, or None."""
    for word in _words(prompt_text):
        if word in _TOPIC_WORDS:
            return word
    return None


def rule_score(prompt_text: str, response_text: str) -> float:
    """The hidden rule: share of the response's words that belong to the prompt's topic.

    Args:
        prompt_text: the prompt; its topic is the first topic name among its words.
        response_text: the decoded response text (special tokens already stripped).

    Returns:
        ``on_topic / max(num_words, RULE_MIN_WORDS)`` in [0, 1], each topic word counted at most
        ``RULE_MAX_REPEATS`` times; 0.0 for a prompt without a topic.
    """
    topic = topic_of(prompt_text)
    if topic is None:
        return 0.0
    words = _words(response_text)
    counts = Counter(word for word in words if word in _TOPIC_WORDS[topic])
    on_topic = sum(min(count, RULE_MAX_REPEATS) for count in counts.values())
    return on_topic / max(len(words), RULE_MIN_WORDS)


@dataclass
class SyntheticTaskConfig:
    """How much of the synthetic task to generate, and from which seed."""

    seed: int = 0
    """Seed of the generator; the same seed gives byte-identical files."""
    num_train: int = 2000
    """Records in ``train.jsonl``."""
    num_test: int = 200
    """Records in ``test.jsonl`` (drawn from an independent stream of the same seed)."""
    min_response_words: int = 8
    """Shortest generated response, in words."""
    max_response_words: int = 16
    """Longest generated response, in words."""
    contrast_fraction: float = 0.0
    """Share of pairs whose second response is an edit of the first that breaks one part of the
    rule (cut below ``RULE_MIN_WORDS`` words, padded with words off the topic, its topic words
    redrawn from only one to three of them, the whole answer one to three topic words in a loop,
    or its topic words swapped for another topic's), so a reward model sees what each part
    costs; the rest are two independent draws. 0 keeps the original stream byte for byte (the
    tokenizer corpus is built from it)."""
    distinct_topic_words: bool = False
    """Draw a reference response's topic words without replacement (all twelve before any one
    twice), and pair every loop of one or two topic words with a varied answer of the same length
    that beats it, instead of sometimes preferring the loop. Then no reference answer (what SFT
    imitates) repeats a topic word it has not had to, and the reward model sees the repeat cap
    as loops losing to varied on-topic answers of their own length. False keeps the original
    stream byte for byte."""
    over_cap_edits: bool = False
    """Add a sixth contrast edit, "over the cap": one topic word of the answer said one to three
    times more than the rule counts, in place of other topic words, so the two answers have the
    same length and the same number of topic words and only the repeat cap tells them apart (the
    answers a policy finds when its reward model counts topic words but not their repeats). False
    keeps the stream byte for byte."""

    def __post_init__(self) -> None:
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(
                f"num_train({self.num_train}) and num_test({self.num_test}) must be >= 0"
            )
        if self.min_response_words < 1:
            raise ValueError(f"min_response_words({self.min_response_words}) must be >= 1")
        if self.min_response_words > self.max_response_words:
            raise ValueError(
                f"min_response_words({self.min_response_words}) exceeds "
                f"max_response_words({self.max_response_words}); raise max_response_words"
            )
        if not 0.0 <= self.contrast_fraction <= 1.0:
            raise ValueError(f"contrast_fraction({self.contrast_fraction}) must be in [0, 1]")


def _prompt(rng: random.Random, topic: str) -> str:
    hint1, hint2 = rng.sample(TOPICS[topic], 2)
    template = rng.choice(PROMPT_TEMPLATES)
    return template.format(topic=topic, hint1=hint1, hint2=hint2)


def _response(rng: random.Random, topic: str, config: SyntheticTaskConfig) -> str:
    """Draw a response whose on-topic rate is itself random, so rule scores spread over [0, 1]."""
    on_topic_rate = rng.uniform(0.05, 0.95)
    other_topics = [name for name in TOPICS if name != topic]
    words = []
    unused: list[str] = []
    for _ in range(rng.randint(config.min_response_words, config.max_response_words)):
        if rng.random() < on_topic_rate:
            if not config.distinct_topic_words:
                words.append(rng.choice(TOPICS[topic]))
                continue
            if not unused:
                unused = list(TOPICS[topic])
            words.append(unused.pop(rng.randrange(len(unused))))
        elif rng.random() < 0.5:
            words.append(rng.choice(FILLER_WORDS))
        else:
            words.append(rng.choice(TOPICS[rng.choice(other_topics)]))
    return " ".join(words) + "."


def _contrast(rng: random.Random, topic: str, response: str, distinct: bool = False,
              over_cap: bool = False) -> tuple[str, str]:
    """An edit of ``response`` that breaks one part of the rule, chosen at random.

    Cutting makes an answer shorter and padding makes it longer, both usually for the worse, so
    that length alone predicts neither side of a pair. The caller orders the pair by the rule:
    an edit is sometimes the better answer (a loop of topic words beats an off-topic answer),
    except with ``distinct``, where a loop is always set against a varied answer that beats it
    (:func:`_loop_pair`). Returns ``response`` (or the varied answer) and the edit.
    """
    words = response.rstrip(".").split()
    edits = ("cut", "pad", "repeat", "loop", "swap") + (("over_cap",) if over_cap else ())
    edit = rng.choice(edits)
    if edit == "loop" and distinct:
        return _loop_pair(rng, topic, response)
    if edit == "over_cap":
        return response, _over_cap(rng, topic, words)
    if edit == "cut":
        words = words[:rng.randint(1, RULE_MIN_WORDS - 1)]
    elif edit == "pad":
        other = [name for name in TOPICS if name != topic]
        words = words + [rng.choice(FILLER_WORDS) if rng.random() < 0.5
                         else rng.choice(TOPICS[rng.choice(other)])
                         for _ in range(rng.randint(2, 8))]
    elif edit == "loop":
        # The degenerate answer of a greedy decoder: a few topic words over and over.
        kept = rng.sample(TOPICS[topic], rng.randint(1, 3))
        words = [kept[i % len(kept)] for i in range(len(words))]
    elif edit == "repeat":
        kept = rng.sample(TOPICS[topic], rng.randint(1, 3))
        words = [rng.choice(kept) if word in _TOPIC_WORDS[topic] else word for word in words]
    else:
        other = rng.choice([name for name in TOPICS if name != topic])
        words = [rng.choice(TOPICS[other]) if word in _TOPIC_WORDS[topic] else word
                 for word in words]
    return response, " ".join(words) + "."


def _over_cap(rng: random.Random, topic: str, words: list[str]) -> str:
    """``words`` with one of its topic words repeated one to three times past the rule's cap,
    written over other topic words (so the count of topic words stays the same); ``words``
    unchanged if it has too few topic words to say one past the cap."""
    positions = [i for i, word in enumerate(words) if word in _TOPIC_WORDS[topic]]
    if len(positions) <= RULE_MAX_REPEATS:
        return " ".join(words) + "."
    repeated = words[rng.choice(positions)]
    target = min(len(positions), RULE_MAX_REPEATS + rng.randint(1, 3))
    others = [i for i in positions if words[i] != repeated]
    rng.shuffle(others)
    edited = list(words)
    while edited.count(repeated) < target and others:
        edited[others.pop()] = repeated
    return " ".join(edited) + "."


def _loop_pair(rng: random.Random, topic: str, response: str) -> tuple[str, str]:
    """A loop of one or two topic words and a varied answer of the same length that beats it.

    The varied answer is ``response`` with off-topic words turned into topic words it does not
    use yet, as many as it takes to count more on-topic words than the loop (whose repeats the
    rule caps); the loop has the same number of words, so only the repeats tell them apart.
    """
    words = response.rstrip(".").split()
    kept = rng.sample(TOPICS[topic], rng.randint(1, 2))
    loop = [kept[i % len(kept)] for i in range(len(words))]
    unused = [word for word in TOPICS[topic] if word not in words]
    rng.shuffle(unused)
    off_topic = [i for i, word in enumerate(words) if word not in _TOPIC_WORDS[topic]]
    rng.shuffle(off_topic)
    while (off_topic and unused
           and rule_score(topic, " ".join(words)) <= rule_score(topic, " ".join(loop))):
        words[off_topic.pop()] = unused.pop()
    return " ".join(words) + ".", " ".join(loop) + "."


def _record(rng: random.Random, config: SyntheticTaskConfig) -> dict[str, str]:
    topic = rng.choice(sorted(TOPICS))
    prompt = _prompt(rng, topic)
    first = _response(rng, topic, config)
    contrast = config.contrast_fraction > 0 and rng.random() < config.contrast_fraction
    if contrast:
        first, second = _contrast(rng, topic, first, config.distinct_topic_words,
                                  config.over_cap_edits)
    else:
        second = _response(rng, topic, config)
    while rule_score(prompt, second) == rule_score(prompt, first):
        # An edit that did not change the score (no topic words to edit): draw independently.
        second = _response(rng, topic, config)
    chosen, rejected = sorted((first, second), key=lambda text: -rule_score(prompt, text))
    return {"prompt": prompt, "response": chosen, "chosen": chosen, "rejected": rejected}


def generate_records(config: SyntheticTaskConfig, split: str = "train") -> list[dict[str, str]]:
    """Generate one split of the task.

    Args:
        config: sizes and seed.
        split: ``"train"`` or ``"test"``; each has its own stream derived from the seed.

    Returns:
        Records with ``prompt``, ``response``, ``chosen`` and ``rejected``; ``response == chosen``
        and ``rule_score(prompt, chosen) > rule_score(prompt, rejected)`` for every record.

    Raises:
        ValueError: for an unknown split.
    """
    sizes = {"train": config.num_train, "test": config.num_test}
    if split not in sizes:
        raise ValueError(f"split({split!r}) must be one of {sorted(sizes)}")
    rng = random.Random(f"megatron_rlhf.synthetic:{config.seed}:{split}")
    return [_record(rng, config) for _ in range(sizes[split])]


def write_task_jsonl(
    out_dir: str | os.PathLike[str], config: SyntheticTaskConfig
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out_dir`` (each atomically).

    Args:
        out_dir: target directory, created if missing.
        config: sizes and seed.

    Returns:
        The written path per split name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        lines = [
            json.dumps(record, ensure_ascii=False) for record in generate_records(config, split)
        ]
        path = out / f"{split}.jsonl"
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{split}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
        paths[split] = path
        logger.info("wrote %d synthetic records to %s", len(lines), path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command line: write the task as JSONL files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=SyntheticTaskConfig.num_train)
    parser.add_argument("--num-test", type=int, default=SyntheticTaskConfig.num_test)
    parser.add_argument("--contrast-fraction", type=float,
                        default=SyntheticTaskConfig.contrast_fraction)
    parser.add_argument("--distinct-topic-words", action="store_true")
    parser.add_argument("--over-cap-edits", action="store_true")
    parser.add_argument("--min-response-words", type=int,
                        default=SyntheticTaskConfig.min_response_words)
    args = parser.parse_args(argv)
    try:
        config = SyntheticTaskConfig(
            seed=args.seed, num_train=args.num_train, num_test=args.num_test,
            contrast_fraction=args.contrast_fraction,
            distinct_topic_words=args.distinct_topic_words, over_cap_edits=args.over_cap_edits,
            min_response_words=args.min_response_words)
    except ValueError as error:
        parser.error(str(error))  # a usage error naming the field, not a traceback
    setup_logging()
    write_task_jsonl(args.out_dir, config)


if __name__ == "__main__":
    main()
