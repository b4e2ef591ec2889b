"""Metric sinks of a run: JSON lines, TensorBoard and a progress bar, on rank 0 only.

On other ranks every method is a no-op, so callers never branch on the rank. The progress bar is
drawn only on a terminal; when stderr is redirected (a log file, a scheduler's output) it is one
plain line every few steps instead of carriage-return frames.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

PROGRESS_LINES = 20
"""About how many lines a run's progress takes when stderr is not a terminal (one every
``ceil(steps / PROGRESS_LINES)`` steps, and the last)."""


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsWriter:
    """Writes ``metrics.jsonl`` (one object per step) and TensorBoard scalars under ``run_dir``.

    Args:
        run_dir: the run directory (created on rank 0).
        total_steps: length of the progress bar.
        tensorboard: also write TensorBoard event files.
        progress: show a tqdm progress bar with the headline metrics (not for a run of no
            steps); when ``stream`` is not a terminal, a line every few steps instead.
        label: the progress bar's name.
        first_step: the step the run starts from (a resumed run's bar starts there); TensorBoard
            shows none of the events earlier runs in ``run_dir`` logged from this step on.
        stream: where progress goes (default: stderr).
    """

    HEADLINE = ("reward_mean", "kl", "samples_per_s", "throughput/tokens_per_s_per_device",
                "throughput/train_mfu", "throughput/generate_mfu", "loss", "accuracy")

    def __init__(self, run_dir: str | os.PathLike[str], total_steps: int,
                 tensorboard: bool = True, progress: bool = True, label: str = "ppo",
                 first_step: int = 0, stream: IO[str] | None = None) -> None:
        self.enabled = _is_rank_zero()
        self._file = None
        self._tb = None
        self._bar = None
        self._lines: IO[str] | None = None
        self._label, self._total, self._done = label, total_steps, first_step
        self._every = max(1, math.ceil(max(1, total_steps - first_step) / PROGRESS_LINES))
        self._start = time.monotonic()
        if not self.enabled:
            return
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides the events an earlier run in this directory logged at steps
            # from first_step on: a fresh run's (0) all, a resumed run's the ones it logs again.
            self._tb = SummaryWriter(str(path / "tensorboard"), purge_step=first_step)
        stream = sys.stderr if stream is None else stream
        if progress and total_steps > 0 and _is_terminal(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=min(first_step, total_steps),
                             desc=label, unit="step", dynamic_ncols=True, file=stream)
        elif progress and total_steps > 0:
            self._lines = stream

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics (floats and ints)."""
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        headline = {k.removeprefix("throughput/"): f"{metrics[k]:.3g}"
                    for k in self.HEADLINE if k in metrics}
        if self._bar is not None:
            # A run's last held-out evaluation is a record of its own after the last step.
            if self._bar.n < self._bar.total:
                self._bar.update(1)
            if headline:  # the final evaluation's record keeps the last step's
                self._bar.set_postfix(headline)
        if self._lines is not None and self._done < self._total:
            self._done += 1
            if self._done % self._every == 0 or self._done == self._total:
                minutes, seconds = divmod(int(time.monotonic() - self._start), 60)
                self._lines.write(f"{self._label}: step {self._done}/{self._total} "
                                  f"[{minutes:02d}:{seconds:02d}] "
                                  + " ".join(f"{k}={v}" for k, v in headline.items()) + "\n")
                self._lines.flush()

    def close(self) -> None:
        """Flush and close every sink."""
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
