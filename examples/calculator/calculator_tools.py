"""The calculator task's user code: the tool the policy calls and the verifier that scores it.

A module outside the package, as a user's would be: the run finds it on ``PYTHONPATH``
(``PYTHONPATH=examples/calculator``) by the names in the configurations,
``calculator_tools:calculator`` (``rollout.tools``) and ``calculator_tools:final_answer_reward``
(``reward.functions``).
"""

from __future__ import annotations

from typing import Any

RESPONSE_CLOSE = "</tool_response>"


def calculator(arguments: dict[str, Any], record: dict[str, Any]) -> str:
    """``a op b`` of two integers, ``op`` one of ``+ - *``; wrong arguments raise, and the run
    shows the policy the error (``rollout.tool_on_error: observe``)."""
    a, b, op = int(arguments["a"]), int(arguments["b"]), arguments["op"]
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def final_answer_reward(prompt: str, response: str, record: dict[str, Any]) -> float:
    """1.0 when the policy's last reply, the text after the last tool answer (the whole
    response without one), is exactly ``record["answer"]``.

    The tool's own answer is not the policy's: a transcript whose tool answer is right but
    whose last reply is not scores 0, so calling the tool and stopping earns nothing.
    """
    final = response.rpartition(RESPONSE_CLOSE)[2]
    return float(final.strip() == str(record["answer"]))
