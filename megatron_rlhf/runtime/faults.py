"""Fault detection for a distributed run: who stopped where, ranks that disagree, preemption.

    tracker = install_fault_tracker(FaultConfig(), timeout_s=600)   # after init_distributed
    with tracker.stage("step", signature=(step, rows)):                # every rank (checked)
        with tracker.stage("experience/reward"):                       # rank-local marker
            ...
    if preemption.requested():                             # every rank, per step (store)
        ...

Every rank records its current stage (name, start time, pid, host) in the job's TCP store at each
stage boundary. A collective that fails (a peer died: "connection closed"; a peer hangs: the
process-group timeout) raises inside some stage; the rank that catches it marks itself as a
victim, waits ``grace_s`` for the other victims to do the same, then reads every rank's record
and raises :class:`RankFailure` naming the ranks that did not fail that way: the rank that raised
(and its error), the rank whose process is gone, or the rank still sitting in its stage.

``stage(name, signature=...)`` with a signature is a collective over the default group: every
rank all-gathers a fixed-size digest of (stage count, name, signature), so ranks that are about to
run different collectives (different micro-batch counts, shapes) fail with a message naming them
instead of deadlocking. Stages without a signature only record.

The tracker is passed explicitly, inside a ``runtime.context.RunContext``; code that runs without
one (unit tests, tools) gets a context whose stages are no-ops.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.distributed import attempt_store, restart_attempt
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.patches import default_group_store, set_default_group_timeout
from megatron_rlhf.runtime.store_exchange import PeerStopped, StoreExchange

logger = get_logger(__name__)

_NAN_POLICIES = ("skip", "stop")
_KEY = "megatron_rlhf/fault/{rank}"
# Substrings of the errors gloo, NCCL and the store raise when a peer is gone or late. Not the
# bare words "nccl" or "gloo": every NCCL error names NCCL, also one whose cause is on this rank.
_COLLECTIVE_ERRORS = ("timed out", "timeout", "connection closed", "connection reset",
                      "broken pipe", "remote worker", "peer", "ncclremoteerror",
                      "ncclsystemerror", "communicator was aborted", "watchdog")
# Causes on this rank that a collective may report: they are the error, not a peer.
_LOCAL_CAUSES = ("out of memory", "ncclinvalidusage", "ncclinvalidargument",
                 "ncclunhandledcudaerror", "illegal memory access", "device-side assert")


@dataclass
class FaultConfig:
    """How failures are detected and handled.

    Attributes:
        check_consistency: at each checked stage boundary, all-gather a digest of the stage and
            its signature and stop with a clear error when ranks disagree (one tiny collective
            per boundary).
        on_nan: NaN/Inf in rewards, values, log-probs, losses or gradients: ``skip`` the step's
            training (no update is applied; the KL controller is left as it was) or ``stop`` the
            run with an error naming the model and stage.
        grace_s: seconds a rank that saw a collective fail waits for the other ranks to report,
            before it names the ranks that stopped; a failure surfaces within the process-group
            timeout (``runtime.distributed.timeout_s``) plus this.
        stop_file: a path whose appearance, checked at every step boundary, stops the run as
            SIGTERM does (finish the step, save, exit 0); for schedulers whose warning cannot
            reach the workers in time (the Slurm example traps ``--signal=B:USR1@...`` in the
            batch shell and touches it). Empty: none. It must not exist when the run starts.
    """

    check_consistency: bool = True
    on_nan: str = "stop"
    grace_s: float = 3.0
    stop_file: str = ""

    def __post_init__(self) -> None:
        if self.on_nan not in _NAN_POLICIES:
            raise ValueError(f"faults.on_nan={self.on_nan!r}: use one of {_NAN_POLICIES}")
        if self.grace_s < 0:
            raise ValueError(f"faults.grace_s={self.grace_s} must be >= 0")


class RankFailure(RuntimeError):
    """Another rank failed, hung or disagrees; the message names it and its stage."""


class NonFiniteError(RuntimeError):
    """NaN or Inf in a model's outputs, losses or gradients (``faults.on_nan=stop``)."""


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` is how a collective reports a dead, late or disagreeing peer.

    A network or store error always is. An error of the backend (NCCL's ``DistBackendError``
    included) is when its text says a peer is gone or late, and is not when it names a cause on
    this rank (out of memory, invalid usage, a CUDA fault): that one is reported as it is. So is
    an error whose class sets ``local_cause = True`` (a reward function that ran past its
    timeout, say), whatever its text.
    """
    if getattr(error, "local_cause", False):
        return False
    if isinstance(error, dist.DistNetworkError | dist.DistStoreError | PeerStopped):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    if any(cause in text for cause in _LOCAL_CAUSES):
        return False
    return any(s in text for s in _COLLECTIVE_ERRORS)


def _digest(*parts: Any) -> int:
    """A stable 31-bit digest of ``repr`` of the parts (same on every rank and run)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


class FaultTracker:
    """This rank's stage records in the job's store, and the diagnosis of failures.

    Args:
        config: detection settings.
        store: the job's key-value store (torchrun's, or the default group's).
    """

    def __init__(self, config: FaultConfig, store: dist.Store) -> None:
        self.config = config
        self.store = store
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.stage_name = "start"
        self.since = time.time()
        self.checked = 0
        self._host = socket.gethostname()
        self._publish("running")

    def _publish(self, status: str, detail: str = "") -> None:
        record = {"stage": self.stage_name, "since": self.since, "status": status,
                  "detail": detail[:500], "pid": os.getpid(), "host": self._host}
        with contextlib.suppress(Exception):  # a dead store must not hide the real error
            self.store.set(_KEY.format(rank=self.rank), json.dumps(record))

    @contextlib.contextmanager
    def stage(self, name: str, signature: Sequence[Any] | None = None) -> Iterator[None]:
        """Record ``name`` as this rank's stage (checked across ranks if ``signature`` is given).

        Raises:
            RankFailure: another rank stopped or disagrees (the message names it).
        """
        outer = (self.stage_name, self.since)
        self.stage_name, self.since = name, time.time()
        self._publish("running")
        try:
            if signature is not None and self.config.check_consistency:
                self._check_consistency(name, tuple(signature))
            yield
        except RankFailure:
            raise
        except Exception as error:
            if is_collective_error(error):
                raise self.diagnose(error) from error
            self._publish("raised", f"{type(error).__name__}: {error}")
            raise
        self.stage_name, self.since = outer

    def _check_consistency(self, name: str, signature: tuple) -> None:
        self.checked += 1
        mine = torch.tensor([self.checked, _digest(name), _digest(signature)], dtype=torch.int64,
                            device=comm_device())
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        # World: every rank of the job runs the same checked stages (SPMD).
        dist.all_gather(gathered, mine, group=dist.group.WORLD)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            return
        described: list = [None] * self.world_size
        dist.all_gather_object(described, (self.checked, name, signature), group=dist.group.WORLD)
        groups: dict[tuple, list[int]] = {}
        for rank, item in enumerate(described):
            groups.setdefault(item, []).append(rank)
        lines = [f"ranks {ranks}: stage #{count} {stage!r} with {sig}"
                 for (count, stage, sig), ranks in groups.items()]
        self._publish("failed", "ranks disagree")
        raise RankFailure("ranks disagree at a stage boundary and would deadlock in the next "
                          "collective:\n  " + "\n  ".join(lines) + "\ncheck that every rank "
                          "runs the same configuration, data and code")

    def diagnose(self, error: BaseException) -> RankFailure:
        """Name the ranks that stopped, after waiting ``grace_s`` for the other victims."""
        self._publish("failed", f"{type(error).__name__}: {error}")
        deadline = time.time() + self.config.grace_s
        records = self._read_records()
        while time.time() < deadline and any(
                r is None or r["status"] == "running" for r in records.values()):
            time.sleep(0.2)
            records = self._read_records()
        culprits = [_describe(rank, record) for rank, record in records.items()
                    if rank != self.rank and (record is None or record["status"] != "failed")]
        if not culprits:
            culprits = ["no other rank reported a failure of its own (all saw collectives "
                        "fail); the first error above is the cause"]
        first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        return RankFailure("; ".join(culprits) + f". Rank {self.rank} was in stage "
                           f"{self.stage_name!r} when a collective failed: {first}")

    def _read_records(self) -> dict[int, dict | None]:
        return read_stage_records(self.store, self.world_size)

    def stopped_ranks(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose record says they raised or failed, or whose process on this
        host is gone: a rank waiting for them outside a collective would wait in vain."""
        stopped = []
        for rank in ranks:
            key = _KEY.format(rank=rank)
            with contextlib.suppress(Exception):  # an unreadable record is no verdict
                if not self.store.check([key]):
                    continue
                record = json.loads(self.store.get(key))
                if record["status"] in ("raised", "failed") or (
                        record["host"] == self._host and _pid_gone(record["pid"])):
                    stopped.append(rank)
        return stopped


def read_stage_records(store: dist.Store, world_size: int) -> dict[int, dict | None]:
    """Every rank's last stage record in ``store`` (None: the rank never wrote one)."""
    records: dict[int, dict | None] = {}
    for rank in range(world_size):
        key = _KEY.format(rank=rank)
        try:
            records[rank] = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store host itself may be the dead rank
            records[rank] = {"status": "unknown", "stage": "?", "since": time.time(),
                             "detail": "the job's store is unreachable (its host, rank 0 "
                                       "or the launcher, is probably gone)",
                             "pid": -1, "host": ""}
    return records


def previous_attempt_report(records: dict[int, dict | None], attempt: int) -> str | None:
    """What the stage records of a torchrun attempt that ended say about why it ended; None when
    it left none. Under NCCL a hung collective ends with the watchdog aborting the processes,
    so no rank of that attempt could print this; its records stay in the agent's store.

    The likely culprit: a rank that raised; else the ranks still in an older stage than the
    last one any rank entered (the others went on into a collective and waited for them).
    """
    if all(record is None for record in records.values()):
        return None
    now = time.time()
    lines = [f"torchrun restarted the job (attempt {attempt}); attempt {attempt - 1} ended "
             "with these stage records:"]
    for rank, record in records.items():
        if record is None:
            lines.append(f"  rank {rank}: no record (it did not start)")
            continue
        state = {"running": "no error reported (killed, aborted by the NCCL watchdog, or hung "
                            "until the restart)",
                 "failed": f"saw a collective fail: {record['detail']}",
                 "raised": f"raised {record['detail']}"}.get(record["status"], record["detail"])
        lines.append(f"  rank {rank}: stage {record['stage']!r}, entered "
                     f"{now - record['since']:.0f} s before this report; {state}")
    lines.append(_likely_culprit(records))
    return "\n".join(lines)


def _likely_culprit(records: dict[int, dict | None]) -> str:
    known = {rank: r for rank, r in records.items() if r is not None and r["status"] != "unknown"}
    raised = [f"rank {rank} raised {r['detail']} in stage {r['stage']!r}"
              for rank, r in known.items() if r["status"] == "raised"]
    if raised:
        return "Likely cause: " + "; ".join(raised)
    if not known:
        return "Likely cause: unknown (the store held no readable record)"
    latest = max(known.values(), key=lambda r: r["since"])["stage"]
    behind = {rank: r for rank, r in known.items() if r["stage"] != latest}
    if behind:
        named = ", ".join(f"rank {rank} in {r['stage']!r}" for rank, r in behind.items())
        return (f"Likely cause: {named}, while the other ranks had gone on to {latest!r} and "
                "waited for them in a collective: hung or died there")
    return (f"Likely cause: every rank was in stage {latest!r}; a collective in it hung or a "
            "rank died in it (under NCCL, TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes the flight "
            "recorder's record of the collective each rank was in)")


def _describe(rank: int, record: dict | None) -> str:
    if record is None:
        return f"rank {rank} never reported a stage (it did not start or died at once)"
    ago = time.time() - record["since"]
    where = f"in stage {record['stage']!r}"
    if record["status"] == "raised":
        return f"rank {rank} raised {record['detail']} {where}"
    if record["status"] == "unknown":
        return f"rank {rank}: {record['detail']}"
    return f"rank {rank} stopped {where} {ago:.0f} s ago ({_process_state(record)})"


def _process_state(record: dict) -> str:
    """Whether the rank's process still exists, when it ran on this host."""
    if record["host"] != socket.gethostname():
        return f"pid {record['pid']} on {record['host']}: killed, crashed or hung"
    if _pid_gone(record["pid"]):
        return f"pid {record['pid']} is gone: killed or crashed"
    return f"pid {record['pid']} is alive but not in the collective: hung or slow"


def _pid_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (a zombie counts as exited)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def install_fault_tracker(config: FaultConfig, timeout_s: float) -> FaultTracker:
    """A tracker of this rank's stages (collective-free; call after ``init_distributed``).

    Also sets the default group's collective timeout to ``timeout_s``, for a group that another
    component created with a different one. Under torchrun's agent the records go into this
    restart attempt's keys of the agent's store, and after a restart rank 0 logs what the
    previous attempt's records say (:func:`previous_attempt_report`).
    """
    set_default_group_timeout(timeout_s)
    attempt = restart_attempt()
    if attempt is None:
        return FaultTracker(config, default_group_store())
    tracker = FaultTracker(config, attempt_store(attempt, timeout_s))
    if attempt > 0 and tracker.rank == 0:
        records = read_stage_records(attempt_store(attempt - 1, timeout_s), tracker.world_size)
        report = previous_attempt_report(records, attempt)
        if report is not None:
            logger.warning("%s", report)
    return tracker


INTERRUPT_REPEAT_S = 2.0
"""Seconds after a first Ctrl-C within which another SIGINT is the same press: a terminal sends
SIGINT to torchrun and every worker, and torchrun's agent forwards it to the workers again."""

EXIT_INTERRUPTED = 128 + signal.SIGINT
"""A run's exit status when it was aborted by a second Ctrl-C (the shell's convention)."""


class PreemptionWatcher:
    """Turns SIGTERM, Ctrl-C (SIGINT), or the appearance of a stop file, into a stop that every
    rank agrees on at a step boundary.

    The handlers only set a flag; :meth:`requested` gathers every rank's flag through the job's
    store (no deadline: a rank that finished its step early waits for the others there), so one
    signalled rank (or one rank that sees the file) is enough and all ranks stop after the same
    step. A second Ctrl-C, more than ``INTERRUPT_REPEAT_S`` after the first, aborts the process
    at once without saving (the default action of SIGINT: no traceback, status 130).

    Args:
        stop_file: a path whose appearance stops the run as SIGTERM does ("": none).
        stopped: which of the given ranks have stopped (the fault tracker's
            ``stopped_ranks``), asked while waiting for the others' flags; None: wait anyway.
    """

    def __init__(self, stop_file: str = "",
                 stopped: Callable[[Iterable[int]], list[int]] | None = None) -> None:
        self.signalled = False
        self.stop_file = stop_file
        self._interrupted_at: float | None = None
        self._exchange = StoreExchange("preemption", stopped=stopped)
        self._previous = {signum: signal.signal(signum, self._handle)
                          for signum in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self._interrupt()
            return
        self.signalled = True
        logger.warning("SIGTERM received: finishing the current step, then saving and exiting")

    def _interrupt(self) -> None:
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at = now
            self.signalled = True
            logger.warning("Ctrl-C received: finishing the current step, then saving and exiting "
                           "(press Ctrl-C again to abort at once without saving)")
        elif now - self._interrupted_at > INTERRUPT_REPEAT_S:
            logger.warning("Ctrl-C again: aborting without saving")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    def requested(self) -> bool:
        """Whether any rank was signalled (every rank calls it; through the job's store)."""
        if self.stop_file and not self.signalled and os.path.exists(self.stop_file):
            self.signalled = True
            logger.warning("stop file %s found: finishing the current step, then saving and "
                           "exiting", self.stop_file)
        return any(self._exchange.all_gather_object(self.signalled))

    def close(self) -> None:
        """Restore the previous SIGTERM and SIGINT handlers."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
