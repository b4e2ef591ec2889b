"""The built-in verifiers against hand-written cases, including ones that fool naive string
matching (thousands commas, fractions against decimals, a trailing period, a boxed answer
followed by more numbers, the first number of a response instead of its last)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_rlhf.rewards.verifiers import (
    exact_reward,
    final_answer,
    format_reward,
    math_equal,
    math_reward,
    overlong_penalty,
    regex_reward,
)


@pytest.mark.parametrize(("prediction", "reference", "equal"), [
    ("1,000", "1000", True),
    ("1,234,567.5", "1234567.5", True),
    ("0.5", "1/2", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "3/4", True),
    ("12.", "12", True),
    ("12.0", "12", True),
    ("$12$", "12", True),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("0.33", "1/3", False),
    ("1,00", "100", False),     # not a thousands grouping: text, and not the same text
    ("x + 1", "x+1", True),     # not numbers: compared as text without white space
    ("Paris", "paris", True),
])
def test_math_equal_compares_numbers_exactly_and_text_normalised(prediction: str,
                                                                 reference: str,
                                                                 equal: bool) -> None:
    assert math_equal(prediction, reference) is equal


@pytest.mark.parametrize(("response", "answer"), [
    ("\\boxed{12}. Check: 12 * 2 = 24", "12"),                   # boxed wins over later numbers
    ("so x = \\boxed{\\frac{1}{2}} (about 0.5)", "\\frac{1}{2}"),  # nested braces
    ("3 apples and 4 apples make 7, so the answer is 12", "12"),  # the last number, not the first
    ("The total is 1,000 dollars.", "1,000"),
    ("It drops to -5 degrees", "-5"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("no number here", None),
])
def test_final_answer_is_the_last_boxed_or_the_last_number(response: str,
                                                           answer: str | None) -> None:
    assert final_answer(response) == answer


@pytest.mark.parametrize(("response", "reference", "score"), [
    ("48 / 2 = 24 in May, so 48 + 24 = 72.", "72", 1.0),
    ("48 / 2 = 24 in May, so 48 + 24 = 72.", "48", 0.0),          # the first number is not it
    ("The answer is \\boxed{12} since 3 * 4 = 12 and 12 + 1 = 13", "12", 1.0),
    ("The answer is 12.", "12", 1.0),
    ("The total is 1,000 dollars", "1000", 1.0),
    ("half: \\boxed{0.5}", "1/2", 1.0),
    ("It is -3", "3", 0.0),
    ("It is -3", "-3", 1.0),
    ("I don't know", "3", 0.0),
    ("so 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K's worked answer
])
def test_math_reward_fallback(response: str, reference: str, score: float) -> None:
    assert math_reward("q", response, {"answer": reference}, use_math_verify=False) == score


def test_math_reward_reads_the_named_field() -> None:
    assert math_reward("q", "it is 7", {"solution": "7"}, answer_field="solution",
                       use_math_verify=False) == 1.0
    with pytest.raises(KeyError, match="answer"):
        math_reward("q", "it is 7", {"solution": "7"}, use_math_verify=False)


def test_exact_and_regex_rewards() -> None:
    assert exact_reward("q", " Paris\n", {"answer": "Paris"}) == 1.0
    assert exact_reward("q", "paris", {"answer": "Paris"}) == 0.0
    assert exact_reward("q", "paris", {"answer": "Paris"}, ignore_case=True) == 1.0
    assert exact_reward("q", "Paris, France", {"answer": "Paris"}) == 0.0
    pattern = r"Answer:\s*(\w+)"
    assert regex_reward("q", "Answer: no. Answer: yes", {}, pattern=pattern) == 1.0
    assert regex_reward("q", "Answer: no. Answer: yes", {"answer": "yes"}, pattern=pattern,
                        answer_field="answer") == 1.0  # the last match counts
    assert regex_reward("q", "Answer: yes. Answer: no", {"answer": "yes"}, pattern=pattern,
                        answer_field="answer") == 0.0
    assert regex_reward("q", "yes", {}, pattern=pattern) == 0.0


def test_format_reward_needs_the_whole_shape() -> None:
    assert format_reward("q", "<think>2 + 2</think> 4", {}) == 1.0
    assert format_reward("q", "4", {}) == 0.0
    assert format_reward("q", "<think></think>4", {}) == 0.0           # no reasoning
    assert format_reward("q", "<think>2 + 2</think>", {}) == 0.0       # no answer after it
    assert format_reward("q", "so \\boxed{4}", {}, pattern=r"(?s).*\\boxed\{.+\}.*") == 1.0


@pytest.mark.parametrize(("length", "penalty"), [
    (0, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (25, -1.0)])
def test_overlong_penalty_is_linear_over_the_buffer(length: int, penalty: float) -> None:
    assert overlong_penalty(length, max_length=20, buffer_length=4) == pytest.approx(penalty)


def test_overlong_penalty_scales_and_refuses_a_bad_buffer() -> None:
    assert overlong_penalty(18, 20, 4, penalty_factor=0.5) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match=r"buffer_length\(0\)"):
        overlong_penalty(5, 20, 0)
    with pytest.raises(ValueError, match=r"buffer_length\(21\)"):
        overlong_penalty(5, 20, 21)


FOOLING = [
    ("37 + 48 = 85", "85", 1.0),
    ("37 + 48 = 85", "37", 0.0),           # in the text, but not the answer
    ("850", "85", 0.0),                    # contains the reference as a substring
    ("8.5", "85", 0.0),                    # the same digits
    ("The answer is 85 apples", "85", 1.0),
    ("The total is 1,000 dollars", "1000", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{12} because 12 + 1 = 13", "12", 1.0),
    ("It is -3", "3", 0.0),
    ("\\boxed{1/3}", "0.333", 0.0),        # a rounded decimal is not the fraction
]
"""Responses that substring, first-number or plain-text matching would grade wrongly."""


@pytest.mark.parametrize(("response", "reference", "score"), FOOLING)
def test_the_fallback_grades_what_fools_string_matching(response: str, reference: str,
                                                        score: float) -> None:
    assert math_reward("q", response, {"answer": reference}, use_math_verify=False) == score


def test_without_math_verify_the_fallback_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises
    for response, reference, score in FOOLING:
        assert math_reward("q", response, {"answer": reference}) == score, response


def test_math_verify_agrees_on_the_same_cases_even_off_the_main_thread() -> None:
    """Runs where the optional extra ``math`` (``math-verify``) is installed."""
    pytest.importorskip("math_verify")
    verdicts = [math_reward("q", response, {"answer": reference})
                for response, reference, _ in FOOLING]
    assert verdicts == [score for _, _, score in FOOLING]
    with ThreadPoolExecutor(1) as pool:  # math-verify's own timeouts would need the main thread
        assert pool.submit(math_reward, "q", "so \\boxed{85}", {"answer": "85"}).result() == 1.0
