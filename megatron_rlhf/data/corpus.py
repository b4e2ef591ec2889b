"""The shipped English corpus that the tiny sentencepiece tokenizer is trained on.

``assets/corpus.txt`` is committed text; this module is the script that generated it, so a test can
check that the asset is not stale. It mixes templated everyday sentences (capitals, numbers,
punctuation, questions) with text of the synthetic task, so the task's words get their own pieces
even in a 512-piece vocabulary. Regenerate after changing either part::

    python -m megatron_rlhf.data.corpus
"""

from __future__ import annotations

import random

from megatron_rlhf.data.synthetic import SyntheticTaskConfig, generate_records
from megatron_rlhf.models.tokenizer import SHIPPED_CORPUS
from megatron_rlhf.runtime.logging import get_logger, setup_logging

logger = get_logger(__name__)

CORPUS_SEED = 20240601
NUM_GENERAL_SENTENCES = 500
NUM_TASK_RECORDS = 500

# fmt: off
_SUBJECTS = (
    "The old man", "A young girl", "My neighbour", "The teacher", "Our team", "The small dog",
    "A tired farmer", "The engineer", "Her brother", "The children", "A careful doctor",
    "The musician", "Every student", "The captain", "His grandmother", "The baker", "A stranger",
    "The pilot", "Two friends", "The new manager", "My cousin", "The quiet librarian",
)
_VERBS = (
    "walked to", "looked at", "talked about", "painted", "cleaned", "visited", "forgot",
    "remembered", "carried", "found", "built", "repaired", "described", "noticed", "followed",
    "opened", "photographed", "wrote about", "sold", "borrowed", "measured", "explained",
)
_OBJECTS = (
    "the river", "a red bicycle", "the library", "an old letter", "the kitchen table",
    "a quiet village", "the mountain path", "a broken clock", "the garden gate", "the morning train",
    "a wooden boat", "the yellow house", "a long story", "the science museum", "a glass of water",
    "the blue notebook", "a heavy suitcase", "the school playground", "an empty bottle",
    "the city map", "a paper kite", "the stone bridge", "a warm jacket", "the evening news",
)
_TIMES = (
    "yesterday", "last winter", "after lunch", "before sunrise", "on Monday", "every evening",
    "during the holidays", "in 1998", "at 7 o'clock", "for 3 hours", "twice a week", "in May",
    "on the 21st of June", "last night", "this morning", "in 2015",
)
_CLAUSES = (
    "because it was raining", "while the radio played", "although nobody asked",
    "and then went home", "with great care", "without saying a word", "as the sun went down",
    "so that everyone could see", "before anyone noticed", "just in time", "after a short break",
    "even though it was late", "and laughed about it", "for the first time",
)
_QUESTIONS = (
    "Why did {s} say that?", "Where is {o}?", "How long does it take to reach {o}?",
    "Can you tell me more about {o}?", "Who {v} {o}?", "What happened {t}?",
    "Is it true that {s} {v} {o}?", "When will we see {o} again?",
)
_FACTS = (
    "Water boils at 100 degrees Celsius at sea level.",
    "A week has 7 days, and a year has 12 months.",
    "The train leaves at 8:45, so please don't be late!",
    "She said, \"Thank you very much for your help.\"",
    "It costs about 20 dollars; that's a fair price.",
    "Plants need light, water and air to grow.",
    "Most people sleep between 6 and 9 hours each night.",
    "The museum is open from Tuesday to Sunday.",
    "Please write your name, address and phone number below.",
    "He counted: one, two, three, four, five.",
    "Good questions often matter more than quick answers.",
    "Reading every day makes writing much easier.",
    "The recipe asks for 2 eggs, 150 grams of flour and a pinch of salt.",
    "If you can't find the key, check the drawer near the door.",
    "Our meeting moved from room 4B to room 12A.",
    "Learning a language takes patience, practice and time.",
)
# fmt: on

_ASCII_COVERAGE = (
    "The quick brown fox jumps over the lazy dog.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
    "Columns\tseparated\tby\ttabs.",
    "Punctuation: ! \" # $ % & ' ( ) * + , - . / : ; < = > ? @ [ \\ ] ^ _ ` { | } ~",
)
"""Every printable ASCII character and tab, so ASCII text round-trips without ``<unk>``."""


def _general_sentence(rng: random.Random) -> str:
    subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    kind = rng.random()
    if kind < 0.2:
        template = rng.choice(_QUESTIONS)
        text = template.format(s=subject.lower(), v=verb, o=obj, t=rng.choice(_TIMES))
        return text[0].upper() + text[1:]
    if kind < 0.3:
        return rng.choice(_FACTS)
    sentence = f"{subject} {verb} {obj} {rng.choice(_TIMES)}"
    if rng.random() < 0.6:
        sentence += f" {rng.choice(_CLAUSES)}"
    return sentence + rng.choice((".", ".", ".", "!"))


def generate_corpus() -> str:
    """Return the corpus text exactly as committed in ``assets/corpus.txt``."""
    rng = random.Random(CORPUS_SEED)
    lines = list(_ASCII_COVERAGE)
    lines.extend(_general_sentence(rng) for _ in range(NUM_GENERAL_SENTENCES))
    task = SyntheticTaskConfig(seed=CORPUS_SEED, num_train=NUM_TASK_RECORDS, num_test=0)
    for record in generate_records(task, "train"):
        lines.extend((record["prompt"], record["chosen"], record["rejected"]))
    return "".join(line + "\n" for line in lines)


def main() -> None:
    """Rewrite ``assets/corpus.txt`` from the generator."""
    setup_logging()
    text = generate_corpus()
    SHIPPED_CORPUS.parent.mkdir(parents=True, exist_ok=True)
    SHIPPED_CORPUS.write_text(text, encoding="utf-8")
    logger.info("wrote %d lines (%d bytes) to %s", text.count("\n"), len(text), SHIPPED_CORPUS)


if __name__ == "__main__":
    main()
