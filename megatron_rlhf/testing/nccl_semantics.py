"""NCCL's semantics on gloo: the test mode in which CPU ranks answer as GPU ranks would.

The product runs on NCCL; the tests run on gloo. Wherever the two backends differ in a way our
code could depend on, this mode makes gloo behave as NCCL does, so that code which would fail on
GPUs fails in CI. It is switched on by ``MEGATRON_RLHF_NCCL_SEMANTICS=1`` (the test suite sets it
for every rank it starts) and installed by :func:`~megatron_rlhf.runtime.distributed.init_distributed`
on a gloo world; it never runs in production. Each rule names the torch source it follows
(torch 2.13 ``torch/distributed/distributed_c10d.py`` and ``ProcessGroupNCCL.cpp``):

1. **One work per batch.** ``batch_isend_irecv`` on a backend that ``supports_coalescing`` (NCCL)
   runs the batch under ``_coalescing_manager(group, device, async_ops=True)`` and returns
   ``cm.works``: a single work for the whole batch, whose ``wait`` covers every send and receive.
   gloo returns one work per operation. Here the batch returns one :class:`CoalescedWork`, which
   exposes only ``wait`` and ``is_completed`` (no gloo-only ``source_rank`` or ``result``).
2. **A fresh group's first operation involves every member.** ``batch_isend_irecv``'s docstring:
   "if this API is the first collective call in the group ..., all ranks of the group must
   participate in this API call; otherwise, the behavior is undefined" (under NCCL, a lazily
   created communicator is set up by its first operation, collectively). Here a batch that is
   the first operation a rank posts on a group waits, in the job's store, for every member to
   post its first operation on that group too; a member that posts nothing, or posts a
   collective instead, makes it fail naming the ranks. A group's first tracked collective
   (:data:`TRACKED_COLLECTIVES`) counts as its first operation.
3. **The watchdog counts from the post.** ProcessGroupNCCL's watchdog thread times each work from
   when it was enqueued and, past the group's timeout, aborts the communicator
   (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, which :mod:`~megatron_rlhf.runtime.distributed` sets:
   the error is raised in the process, not a kill). gloo times a wait from the wait. Here a
   batch's work gets a deadline when it is posted; a background watchdog marks it failed at the
   deadline, whether or not anyone waits, the group is aborted (every later batch on it raises)
   and ``wait`` raises :class:`WatchdogTimeout`.
4. **Group creation in one order.** Under NCCL with a bound device ``new_group`` is a world-wide
   communicator split; ranks that create groups in different orders pair wrong communicators and
   hang. Here every ``new_group`` call writes its member list to the store under its call index,
   and each rank compares its own with rank 0's: a mismatch raises :class:`GroupOrderMismatch`
   at the call. ``split_group``, which torch allows only on NCCL (it needs a bound device), is
   emulated by one ``new_group`` per split in the given order, so the code that uses it on GPUs
   runs on CPU too. :func:`group_calls` counts the calls (each a communicator split under NCCL).
5. **Default group timeout.** A group created without a timeout gets NCCL's default
   (``default_pg_nccl_timeout``, 10 minutes), not gloo's 30.
6. **CUDA tensors only.** A group made with backend ``nccl`` maps only the ``cuda`` device type:
   a host tensor in one of its collectives or point-to-point operations raises ``No backend
   type associated with device type cpu``. Here every tensor a GPU run would hold in host
   memory is marked where it is made (:mod:`~megatron_rlhf.testing.nccl_device_rule`), and a
   collective, ``send``/``recv`` or batched P2P that gets one raises
   :class:`~megatron_rlhf.testing.nccl_device_rule.HostTensorInCollective`, naming the file and
   line of the call and of the tensor's making.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_rlhf.runtime.distributed import NCCL_SEMANTICS_ENV as ENV
from megatron_rlhf.testing import nccl_device_rule

NCCL_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""torch's ``default_pg_nccl_timeout``: a group created without a timeout gets it under NCCL."""

TRACKED_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "all_to_all_single", "barrier", "reduce",
                       "all_gather_object", "broadcast_object_list", "gather", "scatter")
"""Collectives whose first call on a group counts as the group's first operation."""

POINT_TO_POINT = ("send", "recv", "isend", "irecv")
"""Single transfers: only the device rule (6) applies to them."""

_KEY = "megatron_rlhf/nccl_semantics"


class WatchdogTimeout(dist.DistBackendError):
    """A work outlived its group's timeout, counted from its post (NCCL's watchdog)."""


class FreshGroupPartialBatch(RuntimeError):
    """The first operation on a group was a batched P2P that not every member joined."""


class GroupOrderMismatch(RuntimeError):
    """Ranks created process groups in different orders."""


@dataclass
class _GroupState:
    ranks: tuple[int, ...]
    timeout: datetime.timedelta
    used: bool = False
    aborted: str | None = None


@dataclass
class _State:
    original: dict[tuple[object, str], Callable] = field(default_factory=dict)
    groups: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    group_calls: int = 0


_state: _State | None = None


def installed() -> bool:
    return _state is not None


def group_calls() -> int:
    """``new_group`` calls (each an NCCL communicator split) since :func:`install`, counting
    every split of a ``split_group`` call."""
    return _state.group_calls if _state is not None else 0


class CoalescedWork:
    """The single work NCCL returns for a batch of sends and receives.

    A thread of its own waits for the batch's gloo works with the time left until the deadline
    (gloo counts a send's or receive's completion only inside ``wait``, so nothing else can tell
    whether it is done); past the deadline the work fails as NCCL's watchdog fails it, whether
    or not anyone waits, and its group is aborted.
    """

    def __init__(self, works: list[dist.Work], group: dist.ProcessGroup,
                 timeout: datetime.timedelta, description: str) -> None:
        self._group = group
        self._posted = time.monotonic()
        self._deadline = self._posted + timeout.total_seconds()
        self._description = description
        self._error: Exception | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(works,), name="nccl-semantics-watchdog",
                         daemon=True).start()

    def is_completed(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for every operation of the batch; raises what failed it (the watchdog's
        :class:`WatchdogTimeout` past the deadline)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def _watch(self, works: list[dist.Work]) -> None:
        try:
            for work in works:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    self._expire()
                    return
                try:
                    work.wait(datetime.timedelta(seconds=remaining))
                except Exception as error:  # noqa: BLE001 - handed to the waiter
                    if time.monotonic() >= self._deadline - 0.05:
                        self._expire()
                    else:
                        self._error = error
                    return
        finally:
            self._done.set()

    def _expire(self) -> None:
        ran = time.monotonic() - self._posted
        message = (f"[NCCL semantics] Watchdog caught collective operation timeout: "
                   f"{self._description} ran for {ran * 1e3:.0f} milliseconds before timing "
                   f"out (the group's timeout, counted from the post as NCCL's watchdog counts)")
        self._error = WatchdogTimeout(message)
        state = _state.groups.get(self._group) if _state is not None else None
        if state is not None and state.aborted is None:
            state.aborted = message
        print(message, file=sys.stderr, flush=True)


def install() -> None:
    """Make this gloo world answer as NCCL would (idempotent); after ``init_process_group``."""
    global _state
    if _state is not None:
        return
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"{ENV}=1 emulates NCCL on gloo; the world runs "
                           f"{dist.get_backend()}: unset it")
    _state = _State()
    _replace("batch_isend_irecv", _batch_isend_irecv)
    _replace("new_group", _new_group)
    _replace("split_group", _split_group)
    for name in TRACKED_COLLECTIVES:
        _replace(name, _tracked(name))
    for name in POINT_TO_POINT:
        _replace(name, _device_checked(name))
    nccl_device_rule.install()


def uninstall() -> None:
    """Restore torch.distributed (tests of the mode itself)."""
    global _state
    if _state is None:
        return
    for (module, name), function in _state.original.items():
        setattr(module, name, function)
    _state = None
    nccl_device_rule.uninstall()


def _replace(name: str, replacement: Callable) -> None:
    for module in (distributed_c10d, dist):
        _state.original[(module, name)] = getattr(module, name)
        setattr(module, name, replacement)


def _original(name: str) -> Callable:
    return _state.original[(distributed_c10d, name)]


def _group_state(group: dist.ProcessGroup | None) -> _GroupState:
    group = group if group is not None else distributed_c10d._get_default_group()
    state = _state.groups.get(group)
    if state is None:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        state = _state.groups[group] = _GroupState(tuple(dist.get_process_group_ranks(group)),
                                                   timeout)
    if state.aborted is not None:
        raise dist.DistBackendError(f"[NCCL semantics] the communicator of group "
                                    f"{list(state.ranks)} was aborted by the watchdog: "
                                    f"{state.aborted}")
    return state


def _first_operation(group: dist.ProcessGroup | None, kind: str) -> None:
    """Mark the group used; a batch that is its first operation waits for every member."""
    state = _group_state(group)
    if state.used:
        return
    state.used = True
    group_name = distributed_c10d._get_process_group_name(
        group if group is not None else distributed_c10d._get_default_group())
    store = distributed_c10d._get_default_store()
    rank = dist.get_rank()
    store.set(f"{_KEY}/first/{group_name}/{rank}", kind)
    if kind != "batch_isend_irecv":
        return
    others = [r for r in state.ranks if r != rank]
    keys = [f"{_KEY}/first/{group_name}/{r}" for r in others]
    try:
        store.wait(keys, state.timeout)
    except dist.DistStoreError:
        missing = [r for r, key in zip(others, keys, strict=True) if not store.check([key])]
        raise FreshGroupPartialBatch(
            f"[NCCL semantics] the first operation on group {list(state.ranks)} is a batched "
            f"P2P (batch_isend_irecv) that ranks {missing} did not post within the group's "
            f"timeout: under NCCL every member must join a fresh group's first batched P2P "
            f"(torch.distributed.batch_isend_irecv's docstring); run a collective on the group "
            f"first, or have every member post") from None
    kinds = {r: store.get(key).decode() for r, key in zip(others, keys, strict=True)}
    collectives = [r for r, posted in kinds.items() if posted != "batch_isend_irecv"]
    if collectives:
        raise FreshGroupPartialBatch(
            f"[NCCL semantics] the first operation on group {list(state.ranks)} is a batched "
            f"P2P on this rank but a collective on ranks {collectives}: under NCCL every member "
            "must join a fresh group's first batched P2P")


def _batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[CoalescedWork]:
    group = p2p_op_list[0].group if p2p_op_list else None
    nccl_device_rule.check_collective("batch_isend_irecv", p2p_op_list, sys._getframe(1))
    _first_operation(group, "batch_isend_irecv")
    state = _group_state(group)
    works = _original("batch_isend_irecv")(p2p_op_list)
    sends = sum(op.op is dist.isend for op in p2p_op_list)
    work = CoalescedWork(list(works), group or distributed_c10d._get_default_group(),
                         state.timeout, f"WorkNCCL(OpType=COALESCED, sends={sends}, "
                         f"recvs={len(p2p_op_list) - sends}, group={list(state.ranks)})")
    return [work]


def _tracked(name: str) -> Callable:
    function = getattr(distributed_c10d, name)
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        arguments = signature.bind_partial(*args, **kwargs).arguments
        group = arguments.get("group")
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            if not torch.compiler.is_compiling():  # dynamo cannot trace frame inspection
                nccl_device_rule.check_collective(name, arguments.values(), sys._getframe(1))
            _first_operation(group, "collective")
        return function(*args, **kwargs)

    return wrapper


def _device_checked(name: str) -> Callable:
    function = getattr(distributed_c10d, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            nccl_device_rule.check_collective(name, [*args, *kwargs.values()], sys._getframe(1))
        return function(*args, **kwargs)

    return wrapper


def _record_group_call(ranks: Iterable[int] | None, desc: str | None) -> None:
    """Publish this rank's next group creation and compare it with rank 0's."""
    index = _state.group_calls
    _state.group_calls += 1
    members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
    store = distributed_c10d._get_default_store()
    rank = dist.get_rank()
    mine = repr(members)
    store.set(f"{_KEY}/new_group/{index}/{rank}", mine)
    if rank == 0:
        return
    reference_key = f"{_KEY}/new_group/{index}/0"
    store.wait([reference_key])
    reference = store.get(reference_key).decode()
    if reference != mine:
        raise GroupOrderMismatch(
            f"[NCCL semantics] process group creation #{index} ({desc or 'no description'}) "
            f"has members {mine} on rank {rank} but {reference} on rank 0: every rank must "
            "create the same groups in the same order (under NCCL each creation is a "
            "world-wide communicator split)")


def _new_group(ranks=None, timeout=None, backend=None, pg_options=None,
               use_local_synchronization=False, group_desc=None, device_id=None,
               sort_ranks=True):
    if not use_local_synchronization:  # only the members call it then
        _record_group_call(ranks, group_desc)
    timeout = timeout if timeout is not None else NCCL_DEFAULT_TIMEOUT
    return _original("new_group")(ranks, timeout, backend, pg_options,
                                  use_local_synchronization, group_desc, device_id, sort_ranks)


def _split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None,
                 group_desc=None, backend=None):
    """NCCL's ``split_group`` as one ``new_group`` per split, in the given order."""
    if parent_pg is not None and parent_pg is not distributed_c10d._get_default_group():
        raise NotImplementedError("[NCCL semantics] split_group of a group other than the "
                                  "default one is not emulated")
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    rank = dist.get_rank()
    mine = None
    for ranks in split_ranks:
        group = _new_group(sorted(ranks), timeout=timeout, group_desc=group_desc)
        if rank in ranks:
            mine = group
    return mine
