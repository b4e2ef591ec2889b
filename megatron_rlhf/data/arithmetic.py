"""The shipped verifiable task: addition questions with integer answers ("What is 14 + 7?" -> "21").

Every pair ``(a, b)`` of operands in ``[low, high]`` is one question; a seeded shuffle deals them
into three disjoint files of ``{"question", "answer"}`` records, read by the ordinary JSONL
reader (``prompts.reader.fields: {prompt: question}``; SFT also maps ``response: answer``):

- ``sft.jsonl``: the few demonstrations SFT learns the answer format from;
- ``train.jsonl``: GRPO's prompts, whose answers only the math verifier reads;
- ``test.jsonl``: held-out questions, scored by exact answer as the run's evaluation does;

and ``corpus.txt``, every question and answer, which the task's tokenizer is trained on.
``examples/arithmetic/`` holds the files of the default settings (``tools/run_arithmetic.py``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("sft", "train", "test")


@dataclass
class ArithmeticTaskConfig:
    """Operand range and the size of each file.

    Attributes:
        low: smallest operand, >= 0.
        high: largest operand (``high=99`` gives "What is 37 + 48?" questions). The default's
            400 questions are more than the tiny model memorises in a short GRPO run, so what
            it is rewarded for must carry over to questions it has not seen
            (docs/results/rewards.md: with one-digit operands it learned its training
            questions' answers and not addition).
        demonstrations: questions with answers for SFT.
        held_out: questions for the held-out evaluation; the rest are GRPO's prompts.
        seed: seed of the shuffle.
    """

    low: int = 0
    high: int = 19
    demonstrations: int = 64
    held_out: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"low={self.low} and high={self.high} must satisfy 0 <= low <= high")
        pairs = (self.high - self.low + 1) ** 2
        if min(self.demonstrations, self.held_out) < 1 or (
                self.demonstrations + self.held_out >= pairs):
            raise ValueError(f"demonstrations={self.demonstrations} and held_out="
                             f"{self.held_out} must each be >= 1 and leave GRPO some of the "
                             f"{pairs} questions; lower them or widen [low, high]")


def question(a: int, b: int) -> dict[str, str]:
    """One record: ``{"question": "What is a + b?", "answer": "<a + b>"}``."""
    return {"question": f"What is {a} + {b}?", "answer": str(a + b)}


def arithmetic_splits(config: ArithmeticTaskConfig) -> dict[str, list[dict[str, str]]]:
    """The records of each of :data:`SPLITS`: disjoint, together every question once."""
    operands = range(config.low, config.high + 1)
    records = [question(a, b) for a in operands for b in operands]
    random.Random(config.seed).shuffle(records)
    sft_end = config.demonstrations
    test_end = sft_end + config.held_out
    return {"sft": records[:sft_end], "test": records[sft_end:test_end],
            "train": records[test_end:]}


def write_arithmetic_task(directory: str | Path, config: ArithmeticTaskConfig) -> dict[str, Path]:
    """Write ``<split>.jsonl`` for every split and ``corpus.txt``; returns their paths by name
    (``corpus`` for the corpus)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    splits = arithmetic_splits(config)
    for split, records in splits.items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in records))
    paths["corpus"] = out / "corpus.txt"
    # "?" stands apart in the corpus so that no "7?" piece is learned: every operand and answer
    # digit is then encoded as a digit piece of its own, which the model can generalise over.
    paths["corpus"].write_text("".join(f"{r['question'][:-1]} ? {r['answer']}\n"
                                       for split in SPLITS for r in splits[split]))
    return paths
