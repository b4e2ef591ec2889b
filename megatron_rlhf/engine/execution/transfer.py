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

import contextlib
import queue
import threading
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


@dataclass
class _DeferredSends:
    """A batch of a rank that only sends, left to the channels' thread until its receivers post."""

    key: ChannelKey
    posting: list[str]
    receivers: list[int]
    ops: list[dist.P2POp]
    tensors: list[torch.Tensor]
    produced: torch.cuda.Event | None


class TransferChannels:
    """One process group per pair of rank sets that exchange batch rows.

    Rows never move on the world group: under NCCL a send left in flight orders its
    communicator's stream, so on the world group it would hold back every later world collective
    (stage checks, metrics) until its receiver, perhaps still training, takes it; pending
    point-to-point beside other collectives on one communicator is what NCCL documents as unsafe.
    On a pair's own group a send may stay in flight while its rank computes (the pipelined stages
    hide transfers that way): a later transfer on the pair only forgets the batches that have
    completed, and :meth:`drain` (the end of a step) waits for the rest.
    The groups have their own timeout: a transfer may wait through a whole stage of its peer
    (generation, scoring, training) that outlasts the world's collective timeout.

    Neither side posts before the other is ready, so the backend's operations (and NCCL's
    watchdog, which counts from their enqueueing) cover the data movement, not a peer's stage:
    a sender writes one key per receiver into the job's store when its rows are ready; a receiver
    waits for its senders' keys, writes one key per sender saying it posts its receives, and
    posts them; a sender posts its sends once its receivers' keys are there. A rank that
    receives waits for those keys itself. A rank that only sends goes on computing: its batch
    waits in the channels' thread, which posts the batches in their order once their receivers
    are ready and keeps them in flight; a batch this rank then posts itself on the same channel
    waits until its earlier ones are posted (operations on a communicator keep one order on
    every rank). Each wait is a store read of at most ``ready_timeout_s``. A store wait does not
    end when a peer dies, so the waiting side looks every ``poll_s`` whether its peers have
    stopped (``stopped``, the run's fault records) and then raises
    :class:`~megatron_rlhf.runtime.faults.PeerStopped`; what the thread raises is raised at this
    rank's next transfer on the channels or :meth:`drain`.

    Building is collective: every rank creates every group, in the same order.

    Args:
        pairs: the rank sets that exchange rows, as (one side, other side).
        timeout_s: the groups' timeout (``runtime.transfer_timeout_s``).
        store: the job's key-value store for the handshakes (default: the default group's).
        stopped: which of the given ranks have stopped (raised, failed or gone); None: a rank
            waits for its peers up to ``ready_timeout_s`` whatever became of them.
        poll_s: how often a waiting rank asks ``stopped``.
        ready_timeout_s: the longest wait for a peer to be ready (default ``timeout_s``).
    """

    def __init__(self, pairs: Iterable[tuple[Iterable[int], Iterable[int]]],
                 timeout_s: float, store: dist.Store | None = None,
                 stopped: Callable[[Iterable[int]], list[int]] | None = None,
                 poll_s: float = 1.0, ready_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.ready_timeout_s = timeout_s if ready_timeout_s is None else ready_timeout_s
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
        self._unposted: dict[ChannelKey, int] = {key: 0 for key in self._groups}
        self._posted = threading.Condition()
        self._deferred: queue.SimpleQueue[_DeferredSends | None] = queue.SimpleQueue()
        self._poster: threading.Thread | None = None
        self._stream: torch.cuda.Stream | None = None
        self._failure: BaseException | None = None

    def handshake(self, key: ChannelKey, rank: int, receivers: Iterable[int],
                  senders: Iterable[int]) -> list[str]:
        """Say this rank's rows of the channel's next transfer are ready to ``receivers``, wait
        until ``senders`` have said so, then tell ``senders`` this rank posts its receives.

        Every rank of the channel calls it once per transfer, before posting its operations.

        Returns:
            The keys by which ``receivers`` say they post their receives: this rank's sends
            wait for them (:meth:`wait_for_receivers` or :meth:`post_when_received`).

        Raises:
            torch.distributed.DistStoreError: a sender was not ready within ``ready_timeout_s``.
            PeerStopped: a sender stopped before it was ready.
        """
        count = self._transfers[key] = self._transfers[key] + 1
        channel = list(self._groups).index(key)
        name = f"megatron_rlhf/transfer/{channel}/{count}/{{}}/{{}}-{{}}".format
        receivers, senders = sorted(receivers), sorted(senders)
        for receiver in receivers:
            self.store.set(name("ready", rank, receiver), b"1")
        self._await([name("ready", sender, rank) for sender in senders], senders,
                    "their rows of this transfer were ready",
                    "have their rows of this transfer ready")
        for sender in senders:
            self.store.set(name("posting", rank, sender), b"1")
        return [name("posting", receiver, rank) for receiver in receivers]

    def _await(self, keys: list[str], peers: list[int], before: str, within: str) -> None:
        """Wait until every key is in the store, then delete them."""
        if not keys:
            return
        start = looked = time.monotonic()
        pause = 0.001
        # check() rather than a wait with a timeout: every timed-out wait makes c10d print a
        # "waitForInput ... timed out" warning, one a second while a peer computes
        while not self.store.check(keys):
            now = time.monotonic()
            if now - looked >= self.poll_s:
                looked = now
                stopped = self.stopped(peers) if self.stopped is not None else []
                if stopped:
                    raise PeerStopped(f"ranks {stopped} stopped before {before}")
            if now - start >= self.ready_timeout_s:
                raise dist.DistStoreError(
                    f"ranks {peers} did not {within} within "
                    f"runtime.transfer_timeout_s={self.ready_timeout_s:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        for key in keys:
            self.store.delete_key(key)

    def wait_for_receivers(self, key: ChannelKey, posting: list[str],
                           receivers: list[int]) -> None:
        """Before this rank posts a batch that receives: its earlier batches on the channel are
        posted, and ``receivers`` (``posting``, from :meth:`handshake`) post theirs.

        Raises:
            torch.distributed.DistStoreError: a receiver did not post within
                ``ready_timeout_s``.
            PeerStopped: a receiver stopped first.
        """
        with self._posted:
            self._posted.wait_for(lambda: self._failure is not None or not self._unposted[key])
            self._raise_failure()
        self._await(posting, receivers, "they posted their receives of this transfer",
                    "post their receives of this transfer")

    def post_when_received(self, key: ChannelKey, ops: list[dist.P2POp],
                           tensors: list[torch.Tensor], posting: list[str],
                           receivers: list[int]) -> None:
        """Leave a batch of sends (reading ``tensors``) to the channels' thread: it posts the
        batch once ``receivers`` post theirs (``posting``, from :meth:`handshake`) and keeps it
        in flight until the channel is drained. Returns at once."""
        self._raise_failure()
        produced = None
        if tensors[0].is_cuda:  # the thread posts on a stream that waits for what made them
            if self._stream is None:  # made here, so the thread makes no CUDA call but posts
                self._stream = torch.cuda.Stream(tensors[0].device)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(tensors[0].device))
        with self._posted:
            self._unposted[key] += 1
        self._deferred.put(_DeferredSends(key, posting, receivers, ops, tensors, produced))
        if self._poster is None:
            self._poster = threading.Thread(target=self._post_deferred, name="transfer-sends",
                                            daemon=True)
            self._poster.start()

    def _post_deferred(self) -> None:
        while (batch := self._deferred.get()) is not None:
            try:
                self._await(batch.posting, batch.receivers,
                            "they posted their receives of this transfer",
                            "post their receives of this transfer")
                posting = contextlib.nullcontext()
                if batch.produced is not None:
                    self._stream.wait_event(batch.produced)
                    posting = torch.cuda.stream(self._stream)  # and its device
                with posting:
                    requests = dist.batch_isend_irecv(batch.ops)
            except BaseException as error:  # noqa: BLE001 - raised on the compute thread
                with self._posted:
                    self._failure = error
                    self._posted.notify_all()
                return
            with self._posted:
                self._pending[batch.key].extend((request, batch.tensors) for request in requests)
                self._unposted[batch.key] -= 1
                self._posted.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

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

    def release_completed(self, key: ChannelKey) -> None:
        """Forget this rank's batches of sends on ``key``'s channel that have completed, without
        waiting for the others: under NCCL a wait would make the compute stream wait for a
        receiver that may still be training, and sends on one communicator stay in order
        anyway. Raises what failed a batch left to the channels' thread."""
        with self._posted:
            self._raise_failure()
            self._pending[key] = [(request, tensors) for request, tensors in self._pending[key]
                                  if not request.is_completed()]

    def drain(self) -> None:
        """Wait for this rank's sends on every channel, posted or still waiting for their
        receivers (the end of a step)."""
        with self._posted:
            self._posted.wait_for(lambda: self._failure is not None
                                  or not any(self._unposted.values()))
            self._raise_failure()
            batches = [batch for pending in self._pending.values() for batch in pending]
            for pending in self._pending.values():
                pending.clear()
        for request, _ in batches:
            request.wait()

    def close(self) -> None:
        """Drain every channel and end the channels' thread, before the groups are destroyed
        (a move): destroying an NCCL communicator with sends pending flushes them, which can
        block until the timeout, and the thread would otherwise live on, holding the channels,
        once per move."""
        self.drain()
        if self._poster is not None:
            self._deferred.put(None)
            self._poster.join()
            self._poster = None

    @property
    def in_flight(self) -> int:
        """This rank's batches of sends not yet drained, over all channels (posted or
        waiting for their receivers)."""
        with self._posted:
            return (sum(len(pending) for pending in self._pending.values())
                    + sum(self._unposted.values()))


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
        channels: if given, the transfer runs on the channel of the two layouts' rank sets,
            each side posting once the other is ready (the channel's handshake), and a rank
            that only sends returns at once: the channel posts its sends when the receivers
            post theirs and keeps them in flight (``channels.drain`` waits for them). Without
            it, on the world group, and every operation completes before returning. A rank that
            receives waits for its whole batch, sends included (under NCCL one work covers the
            batch).

    Returns:
        This rank's rows of every field under ``target``, or None if it needs none.
    """
    key = channel_key(source.rows, target.rows)
    group = dist.group.WORLD
    rank = dist.get_rank()
    receivers = sorted({t.dst for t in plan if t.src == rank != t.dst})
    posting: list[str] = []
    if channels is not None:
        group = channels.group(key)
        channels.release_completed(key)
        posting = channels.handshake(key, rank, receivers,
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
    if not ops:
        return outputs
    # NCCL answers a batch with ONE work that covers all of it (gloo with one per op): a rank
    # that receives waits for the whole batch, its own sends included; a rank that only sends
    # leaves the batch to its channel, which posts it once the receivers post theirs.
    if channels is not None and not any(op.op is dist.irecv for op in ops):
        channels.post_when_received(key, ops, sends, posting, receivers)
        return outputs
    if channels is not None:
        channels.wait_for_receivers(key, posting, receivers)
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return outputs
