"""Exchanges through the job's key-value store, for ranks that may wait through another model's
stage.

    exchange = StoreExchange("step_end", stopped=tracker.stopped_ranks)
    everyone = exchange.all_gather_object(mine)   # every rank: every rank's object, rank order

A world collective is bounded by the process group's timeout (``distributed.timeout_s``), and
under NCCL the watchdog counts it from when the operation is posted: a rank that posts it early
(under separation, a rank that only generates and scores, at the end of a step) and waits there
through the trainers' updates and weight sync is aborted once that takes longer. A wait in the
store has no such deadline. It does not end when a peer dies either, so the waiting rank asks
``stopped`` (the fault tracker's records) every ``poll_s`` about the ranks that have not arrived
and raises :class:`PeerStopped` naming them; torchrun's agent stops the job when a worker
process exits.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from megatron_rlhf.runtime.patches import default_group_store

_KEY = "megatron_rlhf/exchange/{name}/{round}"
_rounds: dict[str, int] = {}
"""Exchanges of each name this process has started: every rank starts them in one order, so a
round number names the same exchange on every rank (across engines rebuilt by a move too)."""


class PeerStopped(RuntimeError):
    """Ranks this rank waits for outside a collective (a transfer's handshake, a store exchange)
    have stopped."""


class StoreExchange:
    """All-gathers of small picklable objects over every rank, through the job's store.

    Args:
        name: the exchange's name in the store's keys (one per call site).
        store: the job's key-value store (default: the default group's).
        stopped: which of the given ranks have stopped (raised, failed or gone); None: wait for
            them whatever became of them.
        poll_s: how often a waiting rank asks ``stopped``.
    """

    def __init__(self, name: str, store: dist.Store | None = None,
                 stopped: Callable[[Iterable[int]], list[int]] | None = None,
                 poll_s: float = 5.0) -> None:
        self.name = name
        self.store = store if store is not None else default_group_store()
        self.stopped = stopped
        self.poll_s = poll_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank; waits, with no deadline, until
        every rank has given its own. Every rank must call it, in the same order.

        Raises:
            PeerStopped: a rank that had not given its object stopped.
        """
        round_ = _rounds[self.name] = _rounds.get(self.name, -1) + 1
        prefix = _KEY.format(name=self.name, round=round_)
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
        self.store.set(keys[self.rank], pickle.dumps(obj))
        self.store.append(f"{prefix}/arrived", f"{self.rank},")
        if self.store.add(f"{prefix}/count", 1) == self.world_size:
            self.store.set(f"{prefix}/complete", b"1")
        self._await(prefix)
        gathered = [pickle.loads(value) for value in self.store.multi_get(keys)]
        if self.store.add(f"{prefix}/read", 1) == self.world_size:  # the last reader tidies
            for key in (*keys, *(f"{prefix}/{part}" for part in
                                 ("arrived", "count", "complete", "read"))):
                self.store.delete_key(key)
        return gathered

    def _await(self, prefix: str) -> None:
        start = looked = time.monotonic()
        pause = 0.001
        # check() rather than a wait with a timeout: every timed-out wait makes c10d print a
        # "waitForInput ... timed out" warning, one a second while the trainers train
        while not self.store.check([f"{prefix}/complete"]):
            now = time.monotonic()
            if self.stopped is not None and now - looked >= self.poll_s:
                looked = now
                arrived = {int(rank) for rank in
                           self.store.get(f"{prefix}/arrived").decode().split(",") if rank}
                missing = [rank for rank in range(self.world_size) if rank not in arrived]
                stopped = self.stopped(missing)
                if stopped:
                    raise PeerStopped(f"ranks {stopped} stopped before the exchange "
                                      f"{self.name!r} #{prefix.rsplit('/', 1)[1]}, which this "
                                      f"rank waited for {now - start:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
