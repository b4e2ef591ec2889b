"""Reward functions as a user would write them, for the tests (imported by name in workers)."""

from __future__ import annotations

import time
from typing import Any


def answer_in_response(prompt: str, response: str, record: dict[str, Any],
                       bonus: float = 0.0) -> float:
    """1 + bonus when the record's ``answer`` is in the response; refuses a record without one."""
    if "answer" not in record:
        raise KeyError(f"the record has no 'answer': {sorted(record)}")
    return 1.0 + bonus if record["answer"] in response else 0.0


def graded(prompt: str, response: str, record: dict[str, Any]) -> dict[str, float]:
    """A dict result: the score and a number to log beside it."""
    return {"score": 0.5, "length": float(len(response))}


def explodes(prompt: str, response: str, record: dict[str, Any]) -> float:
    raise ZeroDivisionError("the grader divided by zero")


def hangs(prompt: str, response: str, record: dict[str, Any]) -> float:
    time.sleep(60)
    return 1.0


def not_a_number(prompt: str, response: str, record: dict[str, Any]) -> float:
    return float("nan")


def a_string(prompt: str, response: str, record: dict[str, Any]) -> str:
    return "1.0"


def no_score_key(prompt: str, response: str, record: dict[str, Any]) -> dict[str, float]:
    return {"correct": 1.0}


NOT_CALLABLE = 3


def record_matches_prompt(prompt: str, response: str, record: dict[str, Any]) -> dict[str, float]:
    """Refuses a row that came with another prompt's record; scores the record's answer / 10."""
    if " ".join(prompt.split()).lower() != " ".join(record["prompt"].split()).lower():
        raise ValueError(f"the row's prompt {prompt!r} came with the record of "
                         f"{record['prompt']!r}")
    return {"score": float(record["answer"]) / 10, "matched": 1.0}


def stuck_if_flagged(prompt: str, response: str, record: dict[str, Any]) -> float:
    """On a record with ``stuck``, hangs where the worker's timer cannot reach it (as a stuck C
    extension would); 1 elsewhere."""
    if record.get("stuck"):
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return 1.0


def fails_on_dog(prompt: str, response: str, record: dict[str, Any]) -> float:
    """Raises on the record whose prompt mentions a dog; 1 elsewhere."""
    if "dog" in record["prompt"]:
        raise ValueError("cannot grade dogs")
    return 1.0


def slow_and_marked(prompt: str, response: str, record: dict[str, Any], marker: str = "",
                    seconds: float = 0.3) -> float:
    """Touches ``marker`` (the test's sign that scoring is under way), then takes ``seconds``."""
    if marker:
        with open(marker, "a"):
            pass
    time.sleep(seconds)
    return 1.0


def wrong_signature(response: str, answer: str) -> float:
    """Not a reward function's signature: it lacks the prompt and the record."""
    return float(answer in response)


def needs_threshold(prompt: str, response: str, record: dict[str, Any], *,
                    threshold: float) -> float:
    """A keyword argument without a default: the entry must give it."""
    return float(len(response) > threshold)


def length_tenths(prompt: str, response: str, record: dict[str, Any]) -> float:
    """A score that differs between the responses to one prompt: characters / 10."""
    return len(response) / 10
