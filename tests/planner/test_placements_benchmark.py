"""benchmarks/placements.py: how measured stage seconds are read."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


def _benchmark():
    return load_script("benchmarks/placements.py")


def test_stage_seconds_leave_out_waiting_for_other_ranks() -> None:
    bench = _benchmark()
    ranks = [
        # A trainer: generation does not run here; two training updates side by side with the
        # critic's; it enters the weight sync at 10.0 after training and leaves at 10.5.
        {"spans": [("train", "actor", 5.0, 6.0), ("train", "actor", 6.0, 7.5),
                   ("sync_weights", "", 10.0, 10.5)]},
        {"spans": [("train", "critic", 5.2, 6.2), ("train", "critic", 6.2, 7.0),
                   ("sync_weights", "", 10.1, 10.4)]},
        # A shadow: generates for 2 s in two spans, then waits in the sync from 3.0 to 10.6.
        {"spans": [("generate", "shadow_actor", 0.0, 1.5), ("generate", "shadow_actor", 1.5, 2.0),
                   ("sync_weights", "", 3.0, 10.6)]},
        {"spans": [("generate", "shadow_actor", 0.0, 1.2), ("sync_weights", "", 3.0, 10.6)]},
    ]
    seconds = bench.stage_seconds(ranks)
    assert seconds["generate"] == pytest.approx(2.0)      # the slowest generating rank
    # Each sync runs from the last arrival (10.1) to the last exit (10.6).
    assert seconds["sync_weights"] == pytest.approx(0.5)
    # Actor updates [5, 6], [6, 7.5] and critic updates [5.2, 6.2], [6.2, 7]: their union.
    assert seconds["train"] == pytest.approx(2.5)
