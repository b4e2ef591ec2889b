"""How an entry point refuses bad input under torchrun: exit status 2 and one clear message.

Every rank checks the same input and refuses alike, so only rank 0 says why. The other ranks wait
``grace_s`` before exiting: torchrun stops the whole group as soon as its first worker fails,
and a rank that exited first would otherwise get rank 0 killed before its message is out; the
SIGTERM with which torchrun stops them then ends them quietly with status 2. A rank still alive
after the grace (its refusal was its own, rank 0 did not refuse) says why as well.

A configuration is checked by rank 0 first (:class:`RankZeroFirst`): under torchrun the other
ranks wait for its verdict before they import megatron-core, so the check does not share the CPU
with their imports (4 ranks on 2 idle cores: 5.9 s to the message instead of 9.3 s), and they
exit quietly with status 2 when it refuses.
The library itself only raises; this is for the tools' ``main`` functions. Importing this module
imports nothing heavy.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch is imported only where a rank waits for the verdict
    import torch.distributed as dist

T = TypeVar("T")

REFUSAL_GRACE_S = 5.0

VERDICT_TIMEOUT_S = 3600.0
"""The longest a rank waits for rank 0's check of the input (loading a configuration may import
the user's reward functions or run the placement search)."""

_REFUSED, _ACCEPTED, _DECIDED = b"refused", b"accepted", b"decided:"


def refuse(prog: str, message: str, grace_s: float | None = None) -> int:
    """Print ``prog: message`` on rank 0 (any other rank: after ``grace_s``, default
    ``REFUSAL_GRACE_S``, naming itself; a SIGTERM meanwhile exits quietly with status 2) and
    return the exit status for bad input, 2."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
    else:
        previous = signal.signal(signal.SIGTERM, _exit_refused)
        try:
            time.sleep(REFUSAL_GRACE_S if grace_s is None else grace_s)
        finally:
            signal.signal(signal.SIGTERM, previous)
        print(f"{prog}: rank {rank}: {message}", file=sys.stderr, flush=True)
    return 2


def _exit_refused(signum: int, frame: object) -> None:
    """torchrun stops the group after rank 0 refused: exit as rank 0 did, with nothing to say."""
    os._exit(2)


class RankZeroFirst:
    """Rank 0 checks an entry point's input first; the other ranks follow its verdict.

        first = RankZeroFirst("run_ppo")
        if first.refused():              # ranks != 0 wait here, before their heavy imports
            return 2
        try:
            config = load_config(...)    # rank 0 first, then the others
        except ValueError as error:
            return first.refuse(f"bad configuration: {error}")
        first.accept()

    Only under torchrun's agent with more than one rank (its store carries the verdict, under
    a key of this restart attempt); elsewhere every rank checks at once and :meth:`refuse` is
    :func:`refuse`.

    Args:
        prog: the entry point's name, the prefix of its message and of the verdict's key.
    """

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.rank = os.environ.get("RANK", "0")
        self.gated = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
                      and int(os.environ.get("WORLD_SIZE", "1")) > 1)
        self.key = f"megatron_rlhf/refusal/{prog}/verdict"
        self._published = False

    def _store(self) -> dist.Store:
        from megatron_rlhf.runtime.distributed import attempt_store, restart_attempt

        return attempt_store(restart_attempt() or 0, VERDICT_TIMEOUT_S)

    def refused(self) -> bool:
        """On a rank other than 0 under torchrun: wait for rank 0's verdict; whether it refused
        the input (rank 0 has said why; exit with status 2 and say nothing). False elsewhere."""
        if not self.gated or self.rank == "0":
            return False
        store = self._store()
        store.wait([self.key], datetime.timedelta(seconds=VERDICT_TIMEOUT_S))
        if store.get(self.key) != _REFUSED:
            return False
        # Rank 0 exits first, with status 2, so torchrun reports it as the cause; its SIGTERM
        # to this rank then ends it with the same status.
        signal.signal(signal.SIGTERM, _exit_refused)
        time.sleep(REFUSAL_GRACE_S)
        return True

    def refuse(self, message: str) -> int:
        """Say why and return the exit status, 2; rank 0 then tells the waiting ranks. Another
        rank refuses here only input that rank 0 accepted: its refusal is its own, said at once
        naming itself."""
        own = self.gated and self.rank != "0"
        status = refuse(self.prog, message, grace_s=0.0 if own else None)
        self._publish(_REFUSED)
        return status

    def accept(self) -> None:
        """Rank 0: the input is good; the waiting ranks go on."""
        self._publish(_ACCEPTED)

    def decided(self, name: str, decide: Callable[[], T]) -> T:
        """``decide()`` computed on rank 0 and its result on every rank: under torchrun the
        other ranks take rank 0's result from the store (pickled) instead of computing it, so
        the work is done once and every rank holds the same result, where one computed per
        rank could differ (a placement chosen from a CPU profile each machine measured itself).
        Elsewhere every rank decides.

        Raises:
            ValueError: rank 0's ``decide`` raised it (there), or, on another rank, rank 0 could
                not decide (rank 0 has said why).
        """
        if not self.gated:
            return decide()
        store, key = self._store(), f"megatron_rlhf/decided/{self.prog}/{name}"
        if self.rank == "0":
            try:
                value = decide()
            except ValueError:
                store.set(key, _REFUSED)
                raise
            store.set(key, _DECIDED + pickle.dumps(value))
            return value
        store.wait([key], datetime.timedelta(seconds=VERDICT_TIMEOUT_S))
        data = store.get(key)
        if not data.startswith(_DECIDED):
            raise ValueError(f"rank 0 could not decide the {name} (it said why)")
        return pickle.loads(data[len(_DECIDED):])

    def _publish(self, verdict: bytes) -> None:
        """Rank 0 under torchrun: hand ``verdict`` to the waiting ranks (once)."""
        if self.gated and self.rank == "0" and not self._published:
            self._store().set(self.key, verdict)
            self._published = True
