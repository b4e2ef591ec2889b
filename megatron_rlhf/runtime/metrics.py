"""Metric sinks of a run: JSON lines, TensorBoard and a progress bar, on rank 0 only.

On other ranks every method is a no-op, so callers never branch on the rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsWriter:
    """Writes ``metrics.jsonl`` (one object per step) and TensorBoard scalars under ``run_dir``.

    Args:
        run_dir: the run directory (created on rank 0).
        total_steps: length of the progress bar.
        tensorboard: also write TensorBoard event files.
        progress: show a tqdm progress bar with the headline metrics (not for a run of no
            steps).
        label: the progress bar's name.
    """

    HEADLINE = ("reward_mean", "kl", "samples_per_s", "throughput/tokens_per_s_per_device",
                "throughput/train_mfu", "throughput/generate_mfu", "loss", "accuracy")

    def __init__(self, run_dir: str | os.PathLike[str], total_steps: int,
                 tensorboard: bool = True, progress: bool = True, label: str = "ppo") -> None:
        self.enabled = _is_rank_zero()
        self._file = None
        self._tb = None
        self._bar = None
        if not self.enabled:
            return
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(path / "tensorboard"))
        if progress and total_steps > 0:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc=label, unit="step", dynamic_ncols=True)

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
        if self._bar is not None:
            # A run's last held-out evaluation is a record of its own after the last step.
            if self._bar.n < self._bar.total:
                self._bar.update(1)
            self._bar.set_postfix({k.removeprefix("throughput/"): f"{metrics[k]:.3g}"
                                   for k in self.HEADLINE if k in metrics})

    def close(self) -> None:
        """Flush and close every sink."""
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
