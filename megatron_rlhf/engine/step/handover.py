"""Partial rollouts: the shadows take the trained weights at a decode-step boundary of the round
they generate, instead of after it (``rollout.partial_rollouts``).

One step off, the shadows generate step k + 1 while the trainers train step k. When the trainers
are done, each of them adds 1 to a counter in the job's store (:meth:`WeightHandover.announce`);
a generating rank reads it at every stop check of its generation call (:meth:`poll`), and once
every trainer has counted, it enters the weight sync there and decodes on under the new weights,
its unfinished answers keeping their tokens and KV cache (``generation/continuous.py``). Every
other rank, and a generating rank whose round ended first, enters the sync before the round's
experience is scored (:meth:`finish`), so each rank syncs exactly once per step, in the same
order relative to every other collective. The ranks of one tensor-parallel group agree before
entering (an all-reduce of the flag over the group), as they decode in lockstep.

With ``at_check = n > 0`` (``rollout.partial_handover_check``) a generating rank takes the
weights at the n-th stop check of its round instead, waiting there for the trainers if they are
not done: timing no longer decides which tokens are sampled under which weights, so the run is
reproducible bit for bit, resumes included.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.patches import default_group_store


class WeightHandover:
    """One step's hand-over of the trained weights to the shadows.

    Args:
        engine: the placed models; ``engine.sync_weights`` is the collective taken once.
        name: this run's prefix of the store keys (:func:`handover_names`).
        step: the step whose trained weights are handed over.
        trainers: how many ranks train (each announces once).
        at_check: the stop check of the round that takes the weights, waiting for the trainers
            there; 0: the first one after the trainers are done.
    """

    def __init__(self, engine: PPOEngine, name: str, step: int, trainers: int,
                 at_check: int = 0) -> None:
        self.engine = engine
        self.key = f"{name}/{step}"
        self.trainers = trainers
        self.at_check = at_check
        self.checks = 0
        self.synced = False
        self.store = default_group_store()

    def announce(self) -> None:
        """This trainer rank is done training: count it."""
        self.store.add(self.key, 1)

    def poll_for(self, tp_group: dist.ProcessGroup) -> Callable[[], bool]:
        """The ``weight_updates`` of a generating rank of a model whose TP group is
        ``tp_group``: True once it has taken the new weights at this stop check."""
        def poll() -> bool:
            if self.synced:
                return False
            self.checks += 1
            if self.at_check:
                if self.checks < self.at_check:
                    return False
                while self.store.add(self.key, 0) < self.trainers:
                    time.sleep(0.001)
                self._sync()
                return True
            ready = int(self.store.add(self.key, 0) >= self.trainers)
            if dist.get_world_size(tp_group) > 1:  # the TP ranks take the weights together
                agreed = torch.tensor([ready], device=comm_device(tp_group))
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=tp_group)
                ready = int(agreed.item())
            if not ready:
                return False
            self._sync()
            return True

        return poll

    def finish(self) -> None:
        """Take the weights now if this rank has not yet (every rank, before scoring)."""
        if not self.synced:
            self._sync()

    def _sync(self) -> None:
        with self.engine.context.span("sync_weights"):
            self.engine.sync_weights()
        self.synced = True


_RUNS = itertools.count()


def handover_names() -> str:
    """A store-key prefix for one run's hand-overs: every rank builds its runs in the same
    order, so the n-th run has the same name on every rank and runs of one job never share
    keys."""
    return f"partial_rollouts/{next(_RUNS)}"
