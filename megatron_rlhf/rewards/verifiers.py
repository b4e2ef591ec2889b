"""Built-in verifiers: pure Python checks of a decoded response, usable as reward functions.

Each ``*_reward`` function has the reward-function signature ``(prompt, response, record,
**kwargs) -> float``, reads the reference from ``record[answer_field]`` and is registered under
its name, so a config names it directly::

    reward:
      functions:
        - {name: math_reward, weight: 1.0}
        - {name: format_reward, weight: 0.1, pattern: '(?s).*\\\\boxed\\{.+\\}.*'}

Math equivalence uses Hugging Face's ``math-verify`` (the optional extra: ``pip install
megatron_rlhf[math]``) where it is installed and ``use_math_verify`` is true; otherwise the
pure-Python fallback :func:`math_equal`: the response's final answer (the last ``\\boxed{...}``, else the last number)
and the reference compare as exact fractions when both are integers, decimals or fractions
(``1,000``, ``-0.5``, ``1/2``, ``\\frac{1}{2}``, ``12.``), else as normalised text.
:func:`overlong_penalty` is DAPO's soft length penalty (Yu et al. 2025, eq. 13), which a run
applies to the generated token counts with ``reward.overlong_buffer`` (``rewards/overlong.py``);
a reward function sees only text, so it cannot count tokens.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from megatron_rlhf.rewards.functions import register_reward_function

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
"""An integer (optionally with thousands commas), decimal or ``a/b`` fraction in running text."""

_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for position in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position].strip()
    return None


def final_answer(text: str) -> str | None:
    """The answer a response ends with: the last ``\\boxed{}``, else the text after GSM8K's
    ``####``, else the last number; None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rpartition("####")[2].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (integer, decimal, ``a/b``, ``\\frac{a}{b}``, a trailing
    period, ``$`` and thousands commas allowed), or None."""
    text = text.strip().strip("$").strip().rstrip(".").replace("\\!", "").replace(" ", "")
    fraction = _FRAC.match(text)
    if fraction:
        numerator, denominator = parse_number(fraction[1]), parse_number(fraction[2])
        if numerator is None or denominator is None or denominator == 0:
            return None
        return numerator / denominator
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _normalised(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$").rstrip(".")).lower()


def math_equal(prediction: str, reference: str) -> bool:
    """Whether a final answer equals the reference, as numbers when both parse, else as text
    (the pure-Python fallback of :func:`math_reward`)."""
    ours, theirs = parse_number(prediction), parse_number(reference)
    if ours is not None and theirs is not None:
        return ours == theirs
    return _normalised(prediction) == _normalised(reference)


def _math_verify(response: str, reference: str) -> bool | None:
    """``math-verify``'s verdict, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # No timeouts of its own: they use signal.alarm, which fails outside a main thread; the
    # reward pool's per-call timeout (reward.timeout_s) bounds the call instead.
    return bool(verify(parse(reference, parsing_timeout=None),
                       parse(response, parsing_timeout=None), timeout_seconds=None))


@register_reward_function("math_reward")
def math_reward(prompt: str, response: str, record: dict[str, Any], *,
                answer_field: str = "answer", use_math_verify: bool = True) -> float:
    """1.0 when the response's final answer equals ``record[answer_field]``, else 0.0.

    The reference may itself be a worked solution ending in ``#### <answer>`` (GSM8K).
    """
    reference = str(record[answer_field])
    reference = final_answer(reference) if "####" in reference else reference
    if use_math_verify:
        verdict = _math_verify(response, reference)
        if verdict is not None:
            return float(verdict)
    prediction = final_answer(response)
    return float(prediction is not None and math_equal(prediction, reference))


@register_reward_function("exact_reward")
def exact_reward(prompt: str, response: str, record: dict[str, Any], *,
                 answer_field: str = "answer", ignore_case: bool = False) -> float:
    """1.0 when the response, stripped of surrounding white space, is ``record[answer_field]``."""
    ours, theirs = response.strip(), str(record[answer_field]).strip()
    if ignore_case:
        ours, theirs = ours.lower(), theirs.lower()
    return float(ours == theirs)


@register_reward_function("regex_reward")
def regex_reward(prompt: str, response: str, record: dict[str, Any], *, pattern: str,
                 answer_field: str | None = None) -> float:
    """1.0 when ``pattern`` is found in the response; with ``answer_field``, its first group in
    the last match must also equal ``record[answer_field]`` (stripped)."""
    matches = list(re.finditer(pattern, response))
    if not matches:
        return 0.0
    if answer_field is None:
        return 1.0
    return float(matches[-1].group(1).strip() == str(record[answer_field]).strip())


@register_reward_function("format_reward")
def format_reward(prompt: str, response: str, record: dict[str, Any], *,
                  pattern: str = r"(?s)<think>.+?</think>\s*\S.*") -> float:
    """1.0 when the whole response (stripped) matches ``pattern``: by default reasoning in
    ``<think>...</think>`` followed by an answer."""
    return float(re.fullmatch(pattern, response.strip()) is not None)


def overlong_penalty(length: int, max_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens.

    0 up to ``max_length - buffer_length`` tokens, then falling linearly to ``-penalty_factor``
    at ``max_length``, and ``-penalty_factor`` beyond it.

    Raises:
        ValueError: ``buffer_length`` not in ``[1, max_length]``.
    """
    if not 1 <= buffer_length <= max_length:
        raise ValueError(f"buffer_length({buffer_length}) must be in [1, max_length="
                         f"{max_length}]")
    expected = max_length - buffer_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / buffer_length * penalty_factor
    return -penalty_factor
