"""Metric comparisons of the differential tests (placements, variants, resumes).

A metric missing on either side fails the comparison: skipping it would let a renamed or dropped
metric fall out of the test unnoticed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

TIMING = ("step_seconds", "samples_per_s", "rollout/tool_latency_s")
"""Measurements of a run, not results of its math: they differ between identical runs."""
MEASURED_PREFIXES = ("memory/", "checkpoint/", "throughput/")
"""Groups of measurements: memory peaks, throughput, and checkpoint save seconds (present in the
records after saves, which differ between a synchronous and a background save)."""


def is_measurement(key: str) -> bool:
    """Whether a metric measures the run (time, memory) rather than results of its math."""
    return key in TIMING or key.startswith(MEASURED_PREFIXES)


REL, ABS = 2e-4, 2e-5
"""Placements and schedules reduce in different orders: float32 sums agree to about this."""


def missing_metrics(got: Mapping[str, float], want: Mapping[str, float],
                    keys: Iterable[str]) -> list[str]:
    """The ``keys`` absent from ``got`` or ``want``, each marked with the side it is missing on."""
    missing = []
    for key in keys:
        sides = [side for side, metrics in (("got", got), ("reference", want))
                 if key not in metrics]
        missing += [f"{key} (not in {' or '.join(sides)})"] if sides else []
    return missing


def metrics_match(got: Mapping[str, float], want: Mapping[str, float], keys: Iterable[str],
                  rel: float = REL, abs: float = ABS) -> bool:
    """Whether every key is on both sides and agrees within the tolerances."""
    keys = list(keys)
    return not missing_metrics(got, want, keys) and all(
        got[key] == pytest.approx(want[key], rel=rel, abs=abs) for key in keys)


def assert_metrics_match(got: Mapping[str, float], want: Mapping[str, float],
                         keys: Iterable[str], label: str, rel: float = REL,
                         abs: float = ABS) -> None:
    """Fails naming the first metric that is missing on a side or differs.

    Args:
        got: The metrics under test.
        want: The reference metrics.
        keys: The metrics compared; every one must be on both sides.
        label: Prefix of the failure message (which run, which step).
        rel: Relative tolerance.
        abs: Absolute tolerance.
    """
    keys = list(keys)
    missing = missing_metrics(got, want, keys)
    assert not missing, f"{label}: metrics missing: {', '.join(missing)}"
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=rel, abs=abs), (
            f"{label} {key}: {got[key]} vs reference {want[key]}")


def run_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` without measurements (:func:`is_measurement`)."""
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_measurement(k)}
            for line in lines]


def even_token_share(prompt: list[int], response: list[int]) -> float:
    """A rule reward of token ids: the share of even ids in the response (cheap, varied, and
    the same on every rank)."""
    return sum(1 for t in response if t % 2 == 0) / max(1, len(response))
