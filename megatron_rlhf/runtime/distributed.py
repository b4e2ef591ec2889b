"""torch.distributed start-up and shut-down, from torchrun's environment or as a single process.

    init_distributed(DistributedConfig(backend="auto", timeout_s=600))

chooses NCCL when CUDA is available and gloo otherwise. Without torchrun's variables it starts a
world of one process on a free local port, so every code path (process groups, collectives) is the
same in a plain ``python`` run as under torchrun.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import sys
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

NCCL_SEMANTICS_ENV = "MEGATRON_RLHF_NCCL_SEMANTICS"
"""``1``: a gloo world answers with NCCL's semantics (the test suite's default; the emulation is
:mod:`megatron_rlhf.testing.nccl_semantics`, which production never loads)."""

_NCCL_EMULATION = "megatron_rlhf.testing.nccl_semantics"

_BACKENDS = ("auto", "nccl", "gloo")
_LAUNCHER_SIZES = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
"""Variables in which srun, mpirun and PMI launchers give the number of processes started."""


@dataclass
class DistributedConfig:
    """How this process joins the job.

    Attributes:
        backend: ``auto`` (NCCL with CUDA, gloo without), ``nccl`` or ``gloo``.
        timeout_s: timeout of every collective in the default group and the groups built from it;
            a rank that dies or hangs makes the others fail after this many seconds.
    """

    backend: str = "auto"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"distributed.backend={self.backend!r} is not one of {_BACKENDS}")
        if self.timeout_s <= 0:
            raise ValueError(f"distributed.timeout_s={self.timeout_s} must be positive")


def resolve_backend(backend: str) -> str:
    """Turn ``auto`` into the backend for this machine; refuse NCCL without CUDA."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("distributed.backend='nccl' needs CUDA; use 'gloo' (or 'auto') on CPU")
    return backend


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_without_torchrun() -> str | None:
    """The launcher variable that says several processes were started without torchrun's
    variables (each would silently run alone as a world of one), or None."""
    for name in _LAUNCHER_SIZES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1 and (name != "SLURM_STEP_NUM_TASKS"
                                                   or "SLURM_PROCID" in os.environ):
            return f"{name}={value}"
    return None


def local_device_index(local_rank: int, device_count: int) -> int:
    """This process's CUDA device: ``LOCAL_RANK``, or 0 when the process sees one GPU only (each
    process given its own, by ``CUDA_VISIBLE_DEVICES`` or Slurm's ``--gpus-per-task``).

    Raises:
        ValueError: more processes on this node than GPUs it can see.
    """
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    raise ValueError(f"LOCAL_RANK={local_rank} but this process sees {device_count} GPUs "
                     f"(CUDA_VISIBLE_DEVICES={visible}); start at most {device_count} processes "
                     f"per node (torchrun --nproc-per-node {device_count}), or give each "
                     "process a GPU of its own")


def init_distributed(config: DistributedConfig | None = None) -> None:
    """Initialise the default process group (idempotent).

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them; if they
    are absent, starts a one-process world.

    Raises:
        ValueError: several processes were started by another launcher (srun, mpirun) without
            torchrun's variables, or this node has fewer visible GPUs than processes.
    """
    config = config or DistributedConfig()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        launcher = launched_without_torchrun()
        if launcher is not None:
            raise ValueError(f"{launcher}: several processes were started, but without "
                             "torchrun's RANK/WORLD_SIZE each would train alone as a world of "
                             "one; start one torchrun per node (srun --ntasks-per-node=1 "
                             "torchrun --nproc-per-node N ...; examples/slurm/ppo_16x8.sbatch)")
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    backend = resolve_backend(config.backend)
    kwargs = {}
    if torch.cuda.is_available():
        device = torch.device("cuda", local_device_index(int(os.environ.get("LOCAL_RANK", "0")),
                                                         torch.cuda.device_count()))
        torch.cuda.set_device(device)
        if backend == "nccl":
            # Binds the NCCL communicators to this GPU and creates them eagerly: lazily created
            # ones are set up by the first collective, and a first batch_isend_irecv that only
            # some ranks join can then hang.
            kwargs["device_id"] = device
            # A failed or timed-out NCCL collective raises in this process (the fault tracker
            # names the culprit) instead of the watchdog killing it; an explicit setting wins.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=config.timeout_s)
    store = restart_attempt_store(timeout)
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    if backend == "gloo" and nccl_semantics_requested() and dist.is_initialized():
        from megatron_rlhf.testing import nccl_semantics  # the test mode only

        nccl_semantics.install()
    logger.info("initialised %s world of %d ranks%s", backend, dist.get_world_size(),
                " with NCCL's semantics" if nccl_semantics_installed() else "")


def nccl_semantics_requested() -> bool:
    """Whether the environment asks for NCCL's semantics on gloo (:data:`NCCL_SEMANTICS_ENV`)."""
    return os.environ.get(NCCL_SEMANTICS_ENV, "0") not in ("", "0", "false", "False")


def _nccl_emulation() -> ModuleType | None:
    """The NCCL-semantics emulation if this process has loaded it (only the test mode does)."""
    return sys.modules.get(_NCCL_EMULATION)


def nccl_semantics_installed() -> bool:
    """Whether this gloo world answers with NCCL's semantics now."""
    emulation = _nccl_emulation()
    return emulation is not None and emulation.installed()


def supports_split_group() -> bool:
    """Whether ``torch.distributed.split_group`` can be used in this world: NCCL with a device
    bound to the default group, or gloo with NCCL's semantics, which emulate it."""
    if nccl_semantics_installed():
        return True
    default = dist.distributed_c10d._get_default_group()
    return dist.get_backend() == "nccl" and default.bound_device_id is not None


def restart_attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's agent store under a prefix of this restart attempt, or None outside it.

    torchrun (torch 2.13, ``--max-restarts``) restarts the workers against the same store
    without a per-attempt prefix, so the restarted ranks read the process-group addresses the
    dead attempt published (gloo: "connectFullMesh failed ... Connection refused") and no
    restart ever joins; the fault records of the dead attempt would mislead too. A prefix per
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt keys of its own.
    """
    attempt = restart_attempt()
    if attempt is None:
        return None
    return attempt_store(attempt, timeout.total_seconds())


def restart_attempt() -> int | None:
    """This worker's torchrun restart attempt (0 first), or None outside torchrun's agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(attempt: int, timeout_s: float) -> dist.Store:
    """The keys of one torchrun restart attempt in the agent's store (this attempt's process
    group and fault records; an earlier attempt's, read after a restart)."""
    return dist.PrefixStore(f"megatron_rlhf/attempt_{attempt}", _agent_store(timeout_s))


@functools.cache
def _agent_store(timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def new_member_group(ranks: list[int], timeout_s: float, desc: str) -> dist.ProcessGroup | None:
    """``new_group(ranks)`` (collective over the default group) whose members then run one
    collective on it; None on the other ranks.

    A group's first operation must involve every member when it is a batched point-to-point
    (``batch_isend_irecv``'s documented NCCL rule: a lazily created communicator is set up by
    it), and a transfer or weight sync moves data between only some of them. With the warm-up
    no group's first batch is partial, whether the communicator was created eagerly or not.
    """
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), group_desc=desc)
    if dist.get_rank() not in ranks:
        return None
    dist.all_reduce(torch.zeros(1, device=comm_device(group)), group=group)
    return group


def live_groups() -> frozenset[dist.ProcessGroup]:
    """The process groups this process holds now, the default group among them; give it to
    :func:`destroy_groups_since` to keep them."""
    return frozenset(dist.distributed_c10d._world.pg_map)


def destroy_groups_since(kept: frozenset[dist.ProcessGroup]) -> int:
    """Destroy every process group created since ``kept`` was taken (:func:`live_groups`),
    never the default group; returns how many. Each rank destroys its own: the call is local."""
    doomed = [group for group in list(dist.distributed_c10d._world.pg_map)
              if group not in kept and group is not dist.group.WORLD]
    for group in doomed:
        dist.destroy_process_group(group)
    return len(doomed)


def destroy_distributed() -> None:
    """Tear the default process group down if it exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
    emulation = _nccl_emulation()
    if emulation is not None:
        emulation.uninstall()
