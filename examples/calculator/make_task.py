"""Write the calculator task's files: three-digit multiplication questions, with answers.

    python examples/calculator/make_task.py        # rewrites the files next to this script

``sft_tools.jsonl``: demonstrations that call the calculator and copy its answer (a ``turns``
trajectory); ``sft_direct.jsonl``: the same questions answered directly, for the run without
tools; ``train.jsonl``: GRPO's prompts; ``test.jsonl``: held-out questions; ``corpus.txt``:
the demonstrations' text, one piece a line, for the task's tokenizer. Splits are disjoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SIZES = {"sft": 512, "test": 64, "train": 2048}
LOW, HIGH = 100, 999
SEED = 0


def tool_call(a: int, b: int) -> str:
    """The policy's call, in the format the run parses (Qwen2.5's and Llama-3.1's)."""
    arguments = {"name": "calculator", "arguments": {"a": a, "b": b, "op": "*"}}
    return f"<tool_call>{json.dumps(arguments)}</tool_call>"


def records(seed: int = SEED) -> dict[str, list[dict]]:
    """Distinct ``a * b`` questions dealt into :data:`SIZES`' splits."""
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < sum(SIZES.values()):
        pairs.add((rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    splits, start = {}, 0
    for split, size in SIZES.items():
        splits[split] = [{"question": f"What is {a} * {b}?", "answer": str(a * b),
                          "a": a, "b": b} for a, b in ordered[start:start + size]]
        start += size
    return splits


def main() -> None:
    out = Path(__file__).resolve().parent
    splits = records()
    lines = {name: [] for name in ("sft_tools", "sft_direct", "train", "test")}
    corpus = []
    for split, rows in splits.items():
        for row in rows:
            question, answer = row["question"], row["answer"]
            record = {"question": question, "answer": answer}
            if split != "sft":
                lines[split].append(record)
                continue
            corpus += [question, tool_call(row["a"], row["b"]), "<tool_response>", answer,
                       "</tool_response>"]
            lines["sft_direct"].append(record | {"response": answer})
            lines["sft_tools"].append(record | {"turns": [
                {"role": "assistant", "content": tool_call(row["a"], row["b"])},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer}]})
    for name, rows in lines.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "corpus.txt").write_text("".join(line + "\n" for line in corpus))


if __name__ == "__main__":
    main()
