"""Finding and waiting for the processes a launched job starts (through /proc, Linux only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """The running child processes of ``pid`` (torchrun's agent: its workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(stat.parent.name)
        if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds.

    Raises:
        AssertionError: it did not hold within ``timeout_s`` (naming ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
