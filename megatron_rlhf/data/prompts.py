"""The prompts of each PPO step, as a pure function of the step number.

Every rank builds the same ``PromptStream`` and asks it for step ``k``'s batch, so no prompt data
is broadcast, and resuming at step ``k`` needs nothing but ``k``. Each pass over the prompts is a
fresh seeded permutation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

REFILL_ID_STRIDE = 1 << 44
"""Sample ids of refill round ``r`` start at ``r * REFILL_ID_STRIDE``: apart from the first
rounds' ids (``step * batch_size + i``) and the held-out ones (``2**40 + i``,
``engine.evaluation.EVAL_ID_OFFSET``) for any run shorter than 2**40 rows."""


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (so nearby steps and rounds get unrelated permutations)."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class PromptStream:
    """Batches of tokenised prompts, by step.

    Args:
        prompts: token ids of every prompt (each non-empty).
        batch_size: prompts per step.
        seed: seed of the per-pass permutations.
        records: each prompt's whole data record (what reward functions receive); default: an
            empty record each.
        origin: where the prompts come from, for the refusals (e.g. the split that chose them).

    Attributes:
        fingerprint: digest of everything that decides step ``k``'s batch (prompts, batch size,
            seed); a checkpoint records it, so a resumed run can tell whether it reads the same
            data at the same position.

    Raises:
        ValueError: no prompts, an empty prompt, a batch larger than the prompt set, or records
            that do not match the prompts one to one.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], batch_size: int, seed: int,
                 records: Sequence[Mapping[str, Any]] | None = None, origin: str = "") -> None:
        where = f" ({origin})" if origin else ""
        if not prompts:
            raise ValueError(f"the prompt set is empty{where}; check the data paths and the PPO "
                             "split")
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"prompts {empty[:5]} are empty after tokenisation; drop them")
        if batch_size > len(prompts):
            raise ValueError(f"rollout.prompts_per_step({batch_size}) exceeds the "
                             f"{len(prompts)} prompts available{where}; add at least "
                             f"{batch_size - len(prompts)} prompts or set "
                             f"rollout.prompts_per_step <= {len(prompts)}")
        if records is not None and len(records) != len(prompts):
            raise ValueError(f"{len(records)} records for {len(prompts)} prompts; give one "
                             "record per prompt")
        self.prompts = [list(p) for p in prompts]
        self.records = list(records) if records is not None else [{} for _ in prompts]
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_pass = len(self.prompts) // batch_size
        self.fingerprint = hashlib.sha256(
            json.dumps([self.prompts, batch_size, seed]).encode()).hexdigest()[:16]

    def batch(self, step: int, round_index: int = 0) -> tuple[list[list[int]], list[int]]:
        """Step ``step``'s prompts and their sample ids (unique over the run).

        The sample id keys a prompt's sampling noise; it is ``step * batch_size + i``, so the same
        prompt drawn in two passes gets different noise. ``round_index > 0`` asks for the
        prompts of a dynamic-sampling refill round (:meth:`_chosen`), whose ids add
        ``round_index * REFILL_ID_STRIDE``.
        """
        ids = [round_index * REFILL_ID_STRIDE + step * self.batch_size + i
               for i in range(self.batch_size)]
        return [self.prompts[i] for i in self._chosen(step, round_index)], ids

    def batch_records(self, step: int, round_index: int = 0
                      ) -> list[tuple[int, Mapping[str, Any]]]:
        """Step ``step``'s prompts' ``(index in the prompt set, record)``, in :meth:`batch`'s
        order."""
        return [(i, self.records[i]) for i in self._chosen(step, round_index)]

    def _chosen(self, step: int, round_index: int = 0) -> list[int]:
        """Indices of step ``step``'s prompts: a slice of its pass's permutation.

        A refill round draws from a permutation of its own, seeded by step and round, so the
        data a run reads stays a pure function of the step (a resume needs nothing more) and
        the steps' first rounds are the batches of a run without dynamic sampling.
        """
        if round_index:
            seed = hash_seed(self.seed, step, round_index)
            order = torch.randperm(len(self.prompts),
                                   generator=torch.Generator().manual_seed(seed))
            return order[:self.batch_size].tolist()
        pass_index, position = divmod(step, self.batches_per_pass)
        order = torch.randperm(len(self.prompts),
                               generator=torch.Generator().manual_seed(self.seed + pass_index))
        start = position * self.batch_size
        return order[start:start + self.batch_size].tolist()
