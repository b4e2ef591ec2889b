"""Answers that go on across generate calls: a continuous-batching pool kept alive between
the steps of a run (``rollout.continue_answers``).

    pool = AnswerPool(group_size=n)
    pool.add(prompts, indices, budgets)      # the prompt stream, whole groups, in order
    output = pool.run(model, decode_model, groups, version, settings)   # once per step

A call of :func:`~megatron_rlhf.generation.continuous.generate_continuous` ends when its last
prompt is done, so a round lasts as long as its longest answer. A pool instead keeps its
slots, their KV cache and the answers decoding in them from one call to the next. Each call
(:meth:`AnswerPool.run`) admits waiting prompts into free slots as a call does, and ends at
the first stop check where ``groups`` whole groups (``group_size`` contiguous prompts, the
answers to one prompt) have finished; those groups, oldest added first, are its output, and
everything else (answers still decoding, finished groups beyond ``groups``, prompts still
waiting) waits for the next call. The decode batch never shrinks: prompts keep waiting.

Weights change between and during calls. Every answer records, per token, the weight version
that sampled it: ``version`` is the one the model holds when a call starts (an update between
two calls counts when the next one starts), and every ``weight_updates`` that returns True
during a call adds one. The output's ``response_versions`` are each token's version minus the
call's ``version`` (<= 0 for the tokens of earlier calls), the offsets the engine adds to it.

:meth:`AnswerPool.state_dict` restarts the answers still decoding (their prompts wait again,
first; their tokens are dropped) so that what remains, finished answers and waiting prompts,
is plain data a checkpoint holds exactly; a run that saved and its resume continue alike.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rlhf.generation.continuous import ContinuousSettings, _assemble, _SlotBatch
from megatron_rlhf.generation.decode_step import batch_bucket
from megatron_rlhf.generation.output import GenerationOutput


class AnswerPool:
    """The prompts, slots and answers of one generating replica across calls.

    Args:
        group_size: prompts per group; :meth:`add` takes whole groups and :meth:`run` returns
            whole groups.
        slots: decode slots (0: ``batch_bucket`` of the first call's ``groups`` rows under the
            generation's ``micro_batch_size``, the slots one call of that many prompts uses).
    """

    def __init__(self, group_size: int, slots: int = 0) -> None:
        self.group_size = group_size
        self.slots = slots
        self.prompts: dict[int, list[int]] = {}
        self.indices: dict[int, int] = {}
        self.budgets: dict[int, int] = {}
        self.waiting: deque[int] = deque()
        self.responses: dict[int, tuple[torch.Tensor, ...]] = {}
        self.versions: dict[int, list[int]] = {}
        self.next_row = 0
        self.version: int | None = None
        self.batch: _SlotBatch | None = None
        self.decode_model: torch.nn.Module | None = None
        self.taken_ids: list[int] = []
        """The noise ids of the prompts the last :meth:`run` returned, in its order."""

    def add(self, prompts: Sequence[Sequence[int]], indices: Sequence[int],
            budgets: Sequence[int]) -> None:
        """Queue prompts (whole groups, in the stream's order) with their noise ids and
        response budgets (each >= 1)."""
        if len(prompts) % self.group_size:
            raise ValueError(f"{len(prompts)} prompts are not whole groups of "
                             f"{self.group_size}")
        for prompt, index, budget in zip(prompts, indices, budgets, strict=True):
            if budget < 1:
                raise ValueError(f"prompt {index} leaves no room for an answer")
            row = self.next_row
            self.prompts[row], self.indices[row], self.budgets[row] = list(prompt), index, budget
            self.waiting.append(row)
            self.next_row += 1

    @property
    def in_flight(self) -> int:
        """Prompts decoding in the slots."""
        return 0 if self.batch is None else sum(p is not None for p in self.batch.occupant)

    def finished_groups(self) -> list[int]:
        """The groups whose every answer has finished, oldest first (by group number)."""
        counts: dict[int, int] = {}
        for row in self.responses:
            counts[row // self.group_size] = counts.get(row // self.group_size, 0) + 1
        return sorted(g for g, count in counts.items() if count == self.group_size)

    def run(self, model: torch.nn.Module, decode_model: torch.nn.Module | None, groups: int,
            version: int, settings: ContinuousSettings) -> GenerationOutput:
        """Decode until ``groups`` whole groups have finished and return them, oldest first
        (module docstring). ``settings`` are this call's (``weight_updates``, ``on_cache``);
        their ``max_length`` must fit every prompt plus its budget.

        Raises:
            ValueError: fewer than ``groups`` groups are added and not yet returned.
        """
        held = len(self.prompts) // self.group_size
        if held < groups:
            raise ValueError(f"the pool holds {held} groups, fewer than the {groups} asked")
        self._begin(model, decode_model, groups, version, settings)
        batch = self.batch
        while len(self.finished_groups()) < groups:
            free, entering = batch.take_waiting(self.waiting)
            batch.prefill(free, entering)
            steps = batch.decode_until_stop_check()
            if len(self.finished_groups()) >= groups:
                break
            if settings.weight_updates is not None and settings.weight_updates():
                batch.record_update(steps)
                self.version += 1
        return self._take(self.finished_groups()[:groups], version)

    def _begin(self, model: torch.nn.Module, decode_model: torch.nn.Module | None, groups: int,
               version: int, settings: ContinuousSettings) -> None:
        """Make the slots (first call, or after :meth:`state_dict`) or take this call's settings
        and the weight versions the model moved on by since the last call."""
        if settings.lockstep is not None:
            raise ValueError("answers cannot go on across calls under an expert-parallel "
                             "lockstep (ep > 1)")
        if self.batch is None:
            slots = self.slots or batch_bucket(groups * self.group_size,
                                               settings.config.micro_batch_size)
            self.decode_model = decode_model  # kept alive: the decoder holds it weakly
            self.batch = _SlotBatch(model, decode_model, self.prompts, self.indices, self.budgets,
                                    settings, self.waiting, slots)
            self.batch.responses, self.batch.versions = self.responses, self.versions
            self.batch.updates = version
        batch = self.batch
        longest = max((len(self.prompts[r]) + self.budgets[r] for r in self.waiting), default=0)
        if longest > batch.decode_settings.max_length:
            raise ValueError(f"a prompt and its answer need {longest} positions, more than the "
                             f"pool's {batch.decode_settings.max_length}")
        batch.settings, batch.work = settings, []
        if self.version is not None and version != self.version:
            steps = batch.decoder.steps.tolist()  # updates between calls: from the next token
            for _ in range(version - self.version):
                batch.record_update(steps)
        batch.updates = self.version = version

    def _take(self, groups: Sequence[int], version: int) -> GenerationOutput:
        """The answers of ``groups``, in that order, out of the pool: versions as offsets
        from ``version``."""
        batch, n = self.batch, self.group_size
        rows = [g * n + j for g in groups for j in range(n)]
        self.taken_ids = [self.indices[r] for r in rows]
        taken = _assemble([self.prompts[r] for r in rows],
                          {i: self.responses.pop(r) for i, r in enumerate(rows)},
                          batch.settings.pad_id, batch.device, batch.close_work(),
                          {i: self.versions.pop(r) for i, r in enumerate(rows)})
        for row in rows:
            del self.prompts[row], self.indices[row], self.budgets[row]
        offsets = torch.where(taken.response_mask.bool(), taken.response_versions - version, 0)
        return dataclasses.replace(taken, response_versions=offsets)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the pool holds as plain data, after restarting the answers still decoding:
        their prompts wait again, ahead of the others, and their tokens are dropped (module
        docstring). The slots are made again by the next call."""
        if self.batch is not None:
            restarted = sorted(p for p in self.batch.occupant if p is not None)
            for row in restarted:
                del self.versions[row]
            self.waiting = deque([*restarted, *self.waiting])
            self.batch = None
        return {"group_size": self.group_size, "prompts": self.prompts, "indices": self.indices,
                "budgets": self.budgets, "waiting": list(self.waiting),
                "responses": {r: tuple(t.cpu() for t in v) for r, v in self.responses.items()},
                "versions": self.versions, "next_row": self.next_row, "version": self.version}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (the responses onto ``device``)."""
        if state["group_size"] != self.group_size:
            raise ValueError(f"the saved answers come in groups of {state['group_size']}, this "
                             f"run's of {self.group_size}")
        self.prompts, self.indices = dict(state["prompts"]), dict(state["indices"])
        self.budgets, self.waiting = dict(state["budgets"]), deque(state["waiting"])
        self.responses = {r: tuple(t.to(device) for t in v)
                          for r, v in state["responses"].items()}
        self.versions = {r: list(v) for r, v in state["versions"].items()}
        self.next_row, self.version, self.batch = state["next_row"], state["version"], None
