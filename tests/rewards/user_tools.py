"""Tools as a user would write them, for the tests (imported by name in workers)."""

from __future__ import annotations

import time
from typing import Any


def calculator(arguments: dict[str, Any], record: dict[str, Any], digits: int = 0) -> str:
    """``a op b`` of integers, rounded to ``digits``."""
    a, b, op = int(arguments["a"]), int(arguments["b"]), arguments["op"]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return str(round(value, digits))


def hangs(arguments: dict[str, Any], record: dict[str, Any]) -> str:
    time.sleep(60)
    return "late"


def not_text(arguments: dict[str, Any], record: dict[str, Any]) -> str:
    return 42  # type: ignore[return-value]


def record_answer(arguments: dict[str, Any], record: dict[str, Any]) -> str:
    return str(record["answer"])


def two_arguments(arguments: dict[str, Any]) -> str:
    return ""


def naps(arguments: dict[str, Any], record: dict[str, Any]) -> str:
    """Sleeps ``arguments["s"]`` seconds, like a slow search or sandbox."""
    time.sleep(float(arguments["s"]))
    return "rested"


def stuck(arguments: dict[str, Any], record: dict[str, Any]) -> str:
    """Hangs where the worker's timer cannot reach it (as a stuck C extension would)."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)
    return "late"
