"""The progress of a run on the console: a bar on a terminal (a resumed run's starts at its
checkpoint's step and ends at the last), a plain line every few steps when stderr is redirected
(no carriage-return frames in a log file). TensorBoard shows one run per directory: a new run
hides an earlier run's steps, a resumed run the steps it logs again."""

from __future__ import annotations

import io
import time
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


def _scalars(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars("reward_mean")]


def test_tensorboard_shows_a_new_run_alone_and_a_resumed_run_once_per_step(
        tmp_path: Path) -> None:
    def log(first: int, last: int, value: float) -> None:
        time.sleep(1.1)  # event files are read in the order of their names: their start second
        writer = MetricsWriter(tmp_path, last, progress=False, first_step=first)
        for step in range(first, last):
            writer.write(step, {"reward_mean": value + step})
        writer.close()

    log(0, 2, 0.0)
    log(0, 2, 10.0)  # the run directory reused by a new run
    assert _scalars(tmp_path) == [(0, 10.0), (1, 11.0)]
    log(1, 3, 20.0)  # resumed from the checkpoint after step 0
    assert _scalars(tmp_path) == [(0, 10.0), (1, 21.0), (2, 22.0)]
