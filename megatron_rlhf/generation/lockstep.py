"""Decoding in lockstep over a mixture-of-experts model's expert-parallel group.

    lockstep = ExpertLockstep.of(model, pg_collection)   # None for a dense model or ep = 1
    steps = lockstep.most(max_new)                       # every rank loops as far
    if lockstep.all_done(local_done): break              # at the stop checks, agreed
    lockstep.idle_forward()                              # a rank whose rows all stopped

With ``ep > 1`` every MoE layer's token dispatcher exchanges tokens over the expert-parallel
group, a collective: the ranks of a group must run the same number of forwards, although their
prompts differ in number and length and their rows stop at different end-of-sequence tokens. The
decode loop therefore agrees on its length and on when to stop (a max / min over the group at
each stop check), and a rank with nothing left to decode runs an idle forward of one padding
token, whose output is dropped, while the others still decode. A rank with fewer micro-batches
runs idle ones (:meth:`ExpertLockstep.idle_decode`) after its own. Under continuous batching
each round of the loop (a prefill where any rank prefills, the decode steps up to the next stop
check) runs on every rank, idle where there is nothing to run, until every rank is done. A rank
given no prompts at all (an uneven split of a few prompts) runs a whole call idle
(:meth:`ExpertLockstep.idle_call`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.models.forward_backward import causal_padding_mask


class ExpertLockstep:
    """Keeps the ranks of one expert-parallel group at the same number of forwards."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup, pad_id: int) -> None:
        self.model = model
        self.group = group
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.idle_forwards = 0

    @classmethod
    def of(cls, model: torch.nn.Module, pg_collection: ProcessGroupCollection,
           pad_id: int) -> ExpertLockstep | None:
        """The lockstep of ``model``'s expert-parallel group; None when it has one rank."""
        group = getattr(pg_collection, "ep", None)
        if group is None or group.size() == 1:
            return None
        return cls(model, group, pad_id)

    def most(self, value: int) -> int:
        """The largest ``value`` over the group (collective)."""
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor)

    def all_done(self, done: bool) -> bool:
        """Whether every rank of the group is ``done`` (collective)."""
        return self.most(0 if done else 1) == 0

    @torch.no_grad()
    def idle_forward(self) -> None:
        """One forward of a single padding token: the group's collectives, no output."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        self.model(ids, torch.zeros_like(ids), causal_padding_mask(torch.ones_like(ids)))
        self.idle_forwards += 1

    def idle_decode(self, stop_check_interval: int) -> None:
        """A micro-batch with no rows: the decode loop's collectives and forwards, matching a
        micro-batch the other ranks decode (``generate._decode_loop``)."""
        for step in range(self.most(0)):
            if step % stop_check_interval == 0 and self.all_done(True):
                return
            self.idle_forward()

    def idle_rounds(self, stop_check_interval: int) -> None:
        """A continuous-batching call with nothing to decode: the rounds of the loop's
        collectives and forwards (a prefill where another rank prefills, then the decode steps
        up to the next stop check) until every rank of the group is done
        (``continuous.generate_continuous``)."""
        while True:
            if self.most(0):
                self.idle_forward()
            for _ in range(stop_check_interval):
                self.idle_forward()
            if self.all_done(True):
                return

    def idle_call(self, continuous: bool, stop_check_interval: int) -> None:
        """A ``generate_sequences`` call of the group that gives this rank no prompts: its
        collectives and idle forwards, for either decode loop (``continuous``)."""
        if continuous:
            self.idle_rounds(stop_check_interval)
            return
        for _ in range(self.most(0)):
            self.idle_decode(stop_check_interval)
