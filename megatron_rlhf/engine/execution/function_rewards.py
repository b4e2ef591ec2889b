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
from typing import Any

import torch

from megatron_rlhf.rewards import RewardFunctions

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
        return {"function_scores": torch.tensor(result.scores, dtype=torch.float32
                                                ).reshape(len(rows), self.count),
                "reward_errors": torch.tensor(result.errors, dtype=torch.float32)}

    def take_extras(self) -> dict[str, float]:
        """``<key>_total`` and ``<key>_count`` of the kept extras since the last call (summed
        over ranks by ``share_metrics``, which logs their mean as ``<key>``)."""
        sums = {}
        for key, values in self._extras.items():
            sums[f"{key}_total"], sums[f"{key}_count"] = float(sum(values)), float(len(values))
        self._extras.clear()
        return sums

    def close(self) -> None:
        """Stop the worker processes."""
        self.functions.close()
