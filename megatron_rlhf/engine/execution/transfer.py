"""Moving batch rows between the rank sets of different models.

Every field of a PPO batch (token ids, masks, log-probs, values, ...) is a tensor whose first
dimension is the batch. A :class:`RowLayout` says which contiguous rows each rank holds or needs:
a DP replica of a model needs its shard on all of its ranks; a model's outputs are held by the
ranks of its last pipeline stage; the trainers need every row. Moving a batch from one layout to
another is planned by the pure function :func:`plan_transfers` (every rank computes the same plan,
so no metadata is exchanged) and executed with batched asynchronous point-to-point operations by
:func:`execute_transfers`, on the pair's own communicator from :class:`TransferChannels`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.distributed import new_member_group
from megatron_rlhf.runtime.faults import PeerStopped
from megatron_rlhf.runtime.patches import default_group_store


@dataclass(frozen=True)
class RowLayout:
    """Rows ``[start, end)`` of a batch of ``batch_size`` rows held (or needed) by each rank.

    Ranks absent from ``rows`` hold nothing.
    """

    batch_size: int
    rows: Mapping[int, tuple[int, int]]

    def __post_init__(self) -> None:
        for rank, (start, end) in self.rows.items():
            if not 0 <= start <= end <= self.batch_size:
                raise ValueError(f"rank {rank}: rows [{start}, {end}) outside a batch of "
                                 f"{self.batch_size}")

    @classmethod
    def replicated(cls, batch_size: int, ranks: list[int] | range) -> RowLayout:
        """Every listed rank holds every row."""
        return cls(batch_size, {rank: (0, batch_size) for rank in ranks})

    @classmethod
    def sharded(cls, batch_size: int, replicas: list[list[int]]) -> RowLayout:
        """Replica ``d`` (a list of ranks) holds the ``d``-th of ``len(replicas)`` equal shards.

        Raises:
            ValueError: the batch does not split evenly.
        """
        if batch_size % len(replicas):
            raise ValueError(f"batch of {batch_size} rows does not split over {len(replicas)} "
                             "data-parallel replicas; make the batch a multiple of the DP size")
        shard = batch_size // len(replicas)
        return cls(batch_size, {rank: (d * shard, (d + 1) * shard)
                                for d, ranks in enumerate(replicas) for rank in ranks})

    def held_by(self, rank: int) -> tuple[int, int] | None:
        """The row range of ``rank`` or None."""
        return self.rows.get(rank)


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, end)`` go from ``src`` to ``dst`` (``src == dst``: a local copy)."""

    src: int
    dst: int
    start: int
    end: int


def plan_transfers(source: RowLayout, target: RowLayout,
                   node_of: Callable[[int], int] = lambda rank: 0) -> list[Transfer]:
    """Plan how every rank of ``target`` obtains its rows from the holders in ``source``.

    A rank that already holds rows copies them locally; other rows come from a holder on the same
    node when there is one, else from the least loaded holder. The result is deterministic.

    Raises:
        ValueError: some needed rows are held by no rank.
    """
    if source.batch_size != target.batch_size:
        raise ValueError(f"source holds {source.batch_size} rows, target expects "
                         f"{target.batch_size}")
    load: dict[int, int] = {rank: 0 for rank in source.rows}
    plan: list[Transfer] = []
    for dst in sorted(target.rows):
        start, end = target.rows[dst]
        row = start
        while row < end:
            holders = [r for r, (s, e) in sorted(source.rows.items()) if s <= row < e]
            if not holders:
                raise ValueError(f"row {row} needed by rank {dst} is held by no rank")
            if dst in holders:
                src = dst
            else:
                src = min(holders, key=lambda r: (node_of(r) != node_of(dst), load[r], r))
            stop = min(end, source.rows[src][1])
            plan.append(Transfer(src, dst, row, stop))
            if src != dst:
                load[src] += stop - row
            row = stop
    return plan


ChannelKey = frozenset[frozenset[int]]
"""The unordered pair of rank sets that a transfer moves rows between."""


def channel_key(first: Iterable[int], second: Iterable[int]) -> ChannelKey:
    """The channel of transfers between the ranks of ``first`` and those of ``second``."""
    return frozenset({frozenset(first), frozenset(second)})


def _sort_key(key: ChannelKey) -> tuple:
    return tuple(sorted(tuple(sorted(ranks)) for ranks in key))


class TransferChannels:
    """One process group per pair of rank sets that exchange batch rows.

    Rows never move on the world group: under NCCL a send left in flight orders its
    communicator's stream, so on the world group it would hold back every later world collective
    (stage checks, metrics) until its receiver, perhaps still training, takes it; pending
    point-to-point beside other collectives on one communicator is what NCCL documents as unsafe.
    On a pair's own group a send may stay in flight while its rank computes (the pipelined stages
    hide transfers that way): a later transfer on the pair only forgets the batches that have
    completed, and :meth:`drain` (the end of a step) waits for the rest.
    The groups have their own timeout: a receiver may wait through a whole stage (generation,
    scoring) that outlasts the world's collective timeout.

    Receives are posted only when their sender is ready: a sender writes one key per receiver
    into the job's store before it posts its sends, and a receiver waits for its senders' keys
    (up to ``timeout_s``) before it posts its receives. So the backend's operations (and NCCL's
    watchdog, which counts from their enqueueing) cover the data movement, not the sender's
    whole stage; the wait itself is a store read. A store wait does not end when a sender dies, so
    the receiver looks every ``poll_s`` whether its senders have stopped (``stopped``, the run's
    fault records) and then raises :class:`~megatron_rlhf.runtime.faults.PeerStopped`.

    Building is collective: every rank creates every group, in the same order.

    Args:
        pairs: the rank sets that exchange rows, as (one side, other side).
        timeout_s: the groups' timeout and the longest wait for a sender
            (``runtime.transfer_timeout_s``).
        store: the job's key-value store for the handshakes (default: the default group's).
        stopped: which of the given ranks have stopped (raised, failed or gone); None: a
            receiver waits for its senders up to ``timeout_s`` whatever became of them.
        poll_s: how often a waiting receiver asks ``stopped``.
    """

    def __init__(self, pairs: Iterable[tuple[Iterable[int], Iterable[int]]],
                 timeout_s: float, store: dist.Store | None = None,
                 stopped: Callable[[Iterable[int]], list[int]] | None = None,
                 poll_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.store = store if store is not None else default_group_store()
        self.stopped = stopped
        self.poll_s = poll_s
        self._groups: dict[ChannelKey, dist.ProcessGroup | None] = {}
        for key in sorted({channel_key(a, b) for a, b in pairs}, key=_sort_key):
            ranks = sorted(frozenset().union(*key))
            self._groups[key] = None if len(ranks) < 2 else new_member_group(
                ranks, timeout_s, f"transfer_{'_'.join(map(str, ranks))}")
        self._pending: dict[ChannelKey, list] = {key: [] for key in self._groups}
        self._transfers: dict[ChannelKey, int] = {key: 0 for key in self._groups}

    def handshake(self, key: ChannelKey, rank: int, receivers: Iterable[int],
                  senders: Iterable[int]) -> None:
        """Tell ``receivers`` that this rank's rows of the channel's next transfer are ready,
        then wait until ``senders`` have said so for this rank; every rank of the channel calls
        it once per transfer, before posting its operations.

        Raises:
            torch.distributed.DistStoreError: a sender was not ready within ``timeout_s``.
            PeerStopped: a sender stopped before it was ready.
        """
        count = self._transfers[key] = self._transfers[key] + 1
        channel = list(self._groups).index(key)
        name = f"megatron_rlhf/transfer/{channel}/{count}/{{}}-{{}}".format
        for receiver in receivers:
            self.store.set(name(rank, receiver), b"1")
        senders = list(senders)
        ready = [name(sender, rank) for sender in senders]
        if not ready:
            return
        start = looked = time.monotonic()
        pause = 0.001
        # check() rather than a wait with a timeout: every timed-out wait makes c10d print a
        # "waitForInput ... timed out" warning, one a second while a sender computes
        while not self.store.check(ready):
            now = time.monotonic()
            if now - looked >= self.poll_s:
                looked = now
                stopped = self.stopped(senders) if self.stopped is not None else []
                if stopped:
                    raise PeerStopped(f"ranks {stopped} stopped before their rows of this "
                                      "transfer were ready")
            if now - start >= self.timeout_s:
                raise dist.DistStoreError(
                    f"ranks {senders} did not have their rows of this transfer ready within "
                    f"runtime.transfer_timeout_s={self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        for done in ready:
            self.store.delete_key(done)

    @property
    def keys(self) -> list[ChannelKey]:
        """Every channel, in creation order."""
        return list(self._groups)

    def group(self, key: ChannelKey) -> dist.ProcessGroup | None:
        """The group of ``key`` (None for a single rank's local copies).

        Raises:
            KeyError: no channel was built for this pair of rank sets.
        """
        if key not in self._groups:
            sides = " and ".join(str(sorted(ranks)) for ranks in sorted(key, key=sorted))
            raise KeyError(f"no transfer channel between ranks {sides}: the engine moves rows "
                           "between a pair it did not list when it built its channels")
        return self._groups[key]

    def keep_in_flight(self, key: ChannelKey, request: dist.Work,
                       tensors: list[torch.Tensor]) -> None:
        """Hold a batch of sends' handle (and the tensors it reads) until the channel is
        drained."""
        self._pending[key].append((request, tensors))

    def release_completed(self, key: ChannelKey) -> None:
        """Forget this rank's batches of sends on ``key``'s channel that have completed, without
        waiting for the others: under NCCL a wait would make the compute stream wait for a
        receiver that may still be training, and sends on one communicator stay in order
        anyway."""
        self._pending[key] = [(request, tensors) for request, tensors in self._pending[key]
                              if not request.is_completed()]

    def drain(self) -> None:
        """Wait for this rank's sends in flight on every channel (the end of a step)."""
        for pending in self._pending.values():
            for request, _ in pending:
                request.wait()
            pending.clear()

    @property
    def in_flight(self) -> int:
        """This rank's batches of sends not yet drained, over all channels."""
        return sum(len(pending) for pending in self._pending.values())


def execute_transfers(plan: list[Transfer], source: RowLayout, target: RowLayout,
                      fields: Mapping[str, torch.Tensor] | None,
                      schema: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                      channels: TransferChannels | None = None) -> dict[str, torch.Tensor] | None:
    """Run ``plan`` on this rank: send what it holds, receive what it needs.

    Every rank of the job calls this with the same plan (ranks in neither layout return at once).
    Ranks are global ranks of the default process group. Received rows land on the device the
    default group's backend communicates from (this rank's GPU under NCCL, the CPU under gloo);
    rows sent from another device are staged there first.

    Args:
        plan: from :func:`plan_transfers` for ``source`` and ``target``.
        fields: this rank's rows of each field (``source.held_by(rank)`` rows), or None.
        schema: every field's dtype and per-row shape, known to all ranks.
        channels: if given, the transfer runs on the channel of the two layouts' rank sets, once
            its senders are ready (the channel's handshake), and a rank that only sends leaves its sends in flight there (it goes on
            computing; ``channels.drain`` waits for them). Without it, on the world group, and
            every operation completes before returning. A rank that receives waits for its whole
            batch, sends included (under NCCL one work covers the batch).

    Returns:
        This rank's rows of every field under ``target``, or None if it needs none.
    """
    key = channel_key(source.rows, target.rows)
    group = dist.group.WORLD
    rank = dist.get_rank()
    if channels is not None:
        group = channels.group(key)
        channels.release_completed(key)
        channels.handshake(key, rank, {t.dst for t in plan if t.src == rank != t.dst},
                           {t.src for t in plan if t.dst == rank != t.src})
    device = comm_device()
    mine_src, mine_dst = source.held_by(rank), target.held_by(rank)
    outputs: dict[str, torch.Tensor] | None = None
    if mine_dst is not None:
        rows = mine_dst[1] - mine_dst[0]
        outputs = {name: torch.empty((rows, *shape), dtype=dtype, device=device)
                   for name, (dtype, shape) in schema.items()}
    ops: list[dist.P2POp] = []
    sends: list[torch.Tensor] = []
    for transfer in plan:
        if transfer.src == rank and transfer.dst == rank:
            for name in schema:
                outputs[name][transfer.start - mine_dst[0]:transfer.end - mine_dst[0]] = (
                    fields[name][transfer.start - mine_src[0]:transfer.end - mine_src[0]])
        elif transfer.src == rank:
            for name in schema:
                chunk = fields[name][transfer.start - mine_src[0]:transfer.end - mine_src[0]]
                sends.append(chunk.to(device, schema[name][0]).contiguous())
                ops.append(dist.P2POp(dist.isend, sends[-1], transfer.dst, group=group))
        elif transfer.dst == rank:
            for name in schema:
                view = outputs[name][transfer.start - mine_dst[0]:transfer.end - mine_dst[0]]
                ops.append(dist.P2POp(dist.irecv, view, transfer.src, group=group))
    if ops:
        # NCCL answers a batch with ONE work that covers all of it (gloo with one per op): a
        # rank that receives waits for the whole batch, its own sends included; a rank that only
        # sends may leave the batch in flight on its channel.
        requests = dist.batch_isend_irecv(ops)
        if channels is not None and not any(op.op is dist.irecv for op in ops):
            for request in requests:
                channels.keep_in_flight(key, request, sends)
        else:
            for request in requests:
                request.wait()
    return outputs
