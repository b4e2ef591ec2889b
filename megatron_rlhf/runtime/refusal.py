"""How an entry point refuses bad input under torchrun: exit status 2 and one clear message.

Every rank checks the same input and refuses alike, so only rank 0 says why. The other ranks wait
``grace_s`` before exiting: torchrun stops the whole group as soon as its first worker fails,
and a rank that exited first would otherwise get rank 0 killed before its message is out. A rank
still alive after the grace (its refusal was its own, rank 0 did not refuse) says why as well.
The library itself only raises; this is for the tools' ``main`` functions.
"""

from __future__ import annotations

import os
import sys
import time

REFUSAL_GRACE_S = 5.0


def refuse(prog: str, message: str, grace_s: float | None = None) -> int:
    """Print ``prog: message`` on rank 0 (any other rank: after ``grace_s``, default
    ``REFUSAL_GRACE_S``, naming itself) and return the exit status for bad input, 2."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(REFUSAL_GRACE_S if grace_s is None else grace_s)
        print(f"{prog}: rank {rank}: {message}", file=sys.stderr, flush=True)
    return 2
