"""Reward functions inside the experience pass: rows of token ids in, score fields out.

The reward model's output ranks (the TP ranks of its last pipeline stage) score their share of
a chunk's rows with the rule and the reward functions, beside the model's own score; each row
carries its prompt's record from the prompt stream (``PPOAlgorithm.produce`` repeats it for the
``samples_per_prompt`` rows of the prompt), so the record meets the row wherever the row is
scored. The fields ``function_scores`` ``[b, k]`` (each function's unweighted score) and
``reward_errors`` ``[b]`` (failed calls under ``reward.on_error=zero``) travel to the trainers
with the rest of the experience, where ``compute_advantages`` weighs and logs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import torch

from megatron_rlhf.rewards import RewardFunctions
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.metric_reduce import Mean

logger = get_logger(__name__)

WARN_SHARE = 0.25
"""Under ``reward.on_error=zero``, a step whose share of rows with a failed call is above this
is warned about on the console."""

WARN_EVERY_S = 300.0
"""After such a warning, the next one waits this long (the steps in between are counted)."""

Record = tuple[int, Mapping[str, Any]]
"""A prompt's index in the prompt set and its record."""


def row_token_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
                  ) -> list[tuple[list[int], list[int]]]:
    """Every row's ``(prompt ids, response ids)`` without padding, read to the host in one copy
    rather than one synchronising read per row."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    p = prompt_length
    return [(row[:p][valid[:p]].tolist(), row[p:][valid[p:]].tolist())
            for row, valid in zip(ids, mask, strict=True)]


@dataclass
class FunctionRewards:
    """The run's reward functions on decoded rows.

    Args:
        functions: the functions and their worker pool.
        decode: token ids to text (the run's tokenizer).
    """

    functions: RewardFunctions
    decode: Callable[[list[int]], str]
    _extras: dict[str, list[float]] = field(default_factory=dict)
    _rows: int = 0
    _failed_rows: int = 0
    _first_error: str = ""
    _last_warning: float | None = None
    _unwarned_steps: int = 0

    @property
    def count(self) -> int:
        """How many functions score each row (``k``)."""
        return len(self.functions.specs)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
              records: Sequence[Record], keep_extras: bool) -> dict[str, torch.Tensor]:
        """``function_scores`` ``[b, k]`` and ``reward_errors`` ``[b]`` of a share of rows.

        Args:
            records: each row's prompt record.
            keep_extras: keep the dict results' other keys for :meth:`take_extras` (one rank of
                each replica, so that every row counts once).
        """
        rows = row_token_ids(input_ids, attention_mask, prompt_length)
        result = self.functions.score([self.decode(prompt) for prompt, _ in rows],
                                      [self.decode(response) for _, response in rows], records)
        if keep_extras:
            for key, values in result.extras.items():
                self._extras.setdefault(key, []).extend(values)
            self._rows += len(rows)
            self._failed_rows += sum(1 for errors in result.errors if errors)
            self._first_error = self._first_error or result.first_error
        return {"function_scores": torch.tensor(result.scores, dtype=torch.float32
                                                ).reshape(len(rows), self.count),
                "reward_errors": torch.tensor(result.errors, dtype=torch.float32)}

    def take_extras(self) -> dict[str, Mean]:
        """The kept extras since the last call, each key's values as one :class:`Mean` (combined
        over ranks by ``share_metrics``, which logs the mean under the key)."""
        extras = {key: Mean(float(sum(values)), float(len(values)))
                  for key, values in self._extras.items()}
        self._extras.clear()
        return extras

    def warn_failures(self, what: str) -> str | None:
        """Warn on the console, from this rank, when more than :data:`WARN_SHARE` of the rows it
        scored (with ``keep_extras``) since the last call had a failed call (``reward.on_error=
        zero`` scores them 0, which is easy to miss in ``reward/errors``), quoting the first
        failure; at most once per :data:`WARN_EVERY_S`. Call once per step.

        Args:
            what: the rows' step, e.g. ``"step 3"``.

        Returns:
            The warning, or None when none was logged.
        """
        rows, failed, first = self._rows, self._failed_rows, self._first_error
        self._rows, self._failed_rows, self._first_error = 0, 0, ""
        if not rows or failed <= WARN_SHARE * rows:
            return None
        now = monotonic()
        if self._last_warning is not None and now - self._last_warning < WARN_EVERY_S:
            self._unwarned_steps += 1
            return None
        since = (f" ({self._unwarned_steps} more step(s) above that share since the last "
                 "warning)" if self._unwarned_steps else "")
        self._last_warning, self._unwarned_steps = now, 0
        message = (f"reward functions failed on {failed} of the {rows} rows this rank scored in "
                   f"{what} ({failed / rows:.0%}, above {WARN_SHARE:.0%}){since}; "
                   "reward.on_error=zero scores those calls 0 (counted in reward/errors). "
                   f"The first: {first}. Fix the function or the records, or set "
                   f"reward.on_error=error to stop at the first failure; next warning at most "
                   f"{WARN_EVERY_S:.0f} s from now")
        logger.warning("%s", message, extra={"any_rank": True})
        return message

    def close(self) -> None:
        """Stop the worker processes."""
        self.functions.close()
