"""The progress of a run on the console: a bar on a terminal (a resumed run's starts at its
checkpoint's step and ends at the last), a plain line every few steps when stderr is redirected
(no carriage-return frames in a log file)."""

from __future__ import annotations

import io
from pathlib import Path

from megatron_rlhf.runtime.metrics import MetricsWriter


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(tmp_path: Path, stream: io.StringIO, first: int, total: int) -> str:
    writer = MetricsWriter(tmp_path, total, tensorboard=False, label="grpo", first_step=first,
                           stream=stream)
    for step in range(first, total):
        writer.write(step, {"reward_mean": 0.5, "kl": 0.01})
    writer.write(total, {"eval/greedy/rm_score": 1.0})  # the final evaluation's own record
    writer.close()
    return stream.getvalue()


def test_a_resumed_runs_bar_starts_at_its_checkpoint_and_ends_at_the_last_step(
        tmp_path: Path) -> None:
    frames = _run(tmp_path, _Terminal(), 14, 40).split("\r")
    shown = [frame for frame in frames if frame.strip()]
    assert shown[0].startswith("grpo:") and "14/40" in shown[0]
    assert "40/40" in shown[-1] and "reward_mean=0.5" in shown[-1]


def test_a_redirected_console_gets_a_line_every_few_steps(tmp_path: Path) -> None:
    text = _run(tmp_path, io.StringIO(), 14, 40)
    assert "\r" not in text
    lines = text.splitlines()
    # 26 steps to go: one line every 2 steps
    assert len(lines) == 13
    assert lines[0].startswith("grpo: step 16/40 [")
    assert lines[-1].startswith("grpo: step 40/40 [")
    assert lines[-1].endswith("] reward_mean=0.5 kl=0.01")
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 27
