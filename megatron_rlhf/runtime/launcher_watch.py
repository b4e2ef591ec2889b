"""Workers that outlive their launcher stop by themselves.

    watch_launcher(interval_s=1.0)     # after init_distributed; a no-op outside torchrun

torchrun's agent starts the workers, hosts the job's store (single node, or node 0) and tears the
workers down when one fails or the job is stopped. Killed with SIGKILL (``kill -9``, the OOM
killer, a node's cleanup) it cannot do that: its workers would train on to the last step, keep
saving and flood the log with the store's "Broken pipe". A daemon thread in each worker notices
that its parent is no longer the agent that started it (the worker was re-parented) or that the
job's store stopped answering, logs why and ends the process at once.

Ending at once loses nothing: a checkpoint becomes visible only by an atomic rename after all its
files are written (``runtime.checkpoint_store``), so a save cut short leaves a ``.tmp-`` directory
that is never resumed from and is removed by the next save.
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading

import torch.distributed as dist

from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

EXIT_ORPHANED = 75
"""Exit status of a worker that stopped because its launcher is gone (EX_TEMPFAIL: resumable)."""
_TORCHRUN_VARIABLE = "TORCHELASTIC_RUN_ID"
_PROBE_KEY = "megatron_rlhf/launcher_watch"
_started: list[threading.Thread] = []  # one watch per process, however often it is asked for


class LauncherWatch:
    """Polls whether this worker's launcher and store are still there.

    Args:
        launcher_pid: the parent process at start (torchrun's agent).
        store: the job's store, probed with a cheap ``check``; None: not probed.
        store_failures: consecutive failed probes that mean the store is gone (one can be a
            passing network fault).
    """

    def __init__(self, launcher_pid: int, store: dist.Store | None = None,
                 store_failures: int = 3) -> None:
        self.launcher_pid = launcher_pid
        self.store = store
        self.store_failures = store_failures
        self._failed_probes = 0

    def problem(self) -> str | None:
        """Why this worker should stop, or None while its launcher and store are there."""
        parent = os.getppid()
        if parent != self.launcher_pid:
            return (f"its launcher (torchrun's agent, pid {self.launcher_pid}) is gone: the "
                    f"worker now belongs to pid {parent}")
        if self.store is None:
            return None
        try:
            self.store.check([_PROBE_KEY])
            self._failed_probes = 0
        except Exception as error:  # noqa: BLE001 - any store error counts as a failed probe
            self._failed_probes += 1
            if self._failed_probes >= self.store_failures:
                return (f"the job's store stopped answering ({self._failed_probes} probes: "
                        f"{type(error).__name__}: {str(error).splitlines()[0][:200]})")
        return None

    def run(self, interval_s: float, stop: threading.Event) -> None:
        """Poll every ``interval_s`` seconds until ``stop`` is set; end the process when
        :meth:`problem` says why."""
        while not stop.wait(interval_s):
            reason = self.problem()
            if reason is not None:
                logger.error("stopping rank %s: %s. The last complete checkpoint is intact; "
                             "an unfinished save is left as a .tmp- directory that is never "
                             "resumed from", os.environ.get("RANK", "?"), reason)
                os._exit(EXIT_ORPHANED)


def _probe_store() -> dist.Store | None:
    """A client connection of its own to the job's store (MASTER_ADDR:MASTER_PORT), so that the
    probes never interleave with the process group's use of its connection; None if it cannot be
    opened."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=datetime.timedelta(seconds=30))
    except Exception as error:  # noqa: BLE001 - the parent check still runs without it
        logger.debug("launcher watch: no store probe (%s)", error)
        return None


def watch_launcher(interval_s: float = 1.0) -> bool:
    """Start the watch in a daemon thread when this process runs under torchrun (idempotent).

    Returns:
        Whether a watch runs in this process.
    """
    if _started:
        return True
    if _TORCHRUN_VARIABLE not in os.environ:
        return False
    watch, stop = LauncherWatch(os.getppid()), threading.Event()

    def run() -> None:
        watch.store = _probe_store()
        watch.run(interval_s, stop)

    def finish() -> None:
        # A daemon thread still inside the store's C++ code while the interpreter shuts down can
        # abort the process after a successful run: stop it first.
        stop.set()
        thread.join(timeout=10)

    thread = threading.Thread(target=run, name="launcher-watch", daemon=True)
    thread.start()
    atexit.register(finish)
    _started.append(thread)
    return True
