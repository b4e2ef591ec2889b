"""The NCCL-semantics mode: gloo ranks answer each rule as NCCL would, and fail as NCCL fails."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.runtime.distributed import supports_split_group
from megatron_rlhf.testing import nccl_semantics
from tests.multirank import run_on_ranks

pytestmark = pytest.mark.multirank


def _exchange(ops_for_rank) -> list:
    rank = dist.get_rank()
    peer = 1 - rank
    out = torch.full((3,), float(rank))
    into = [torch.empty(3), torch.empty(3)]
    ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into[0], peer),
           dist.P2POp(dist.isend, out * 10, peer), dist.P2POp(dist.irecv, into[1], peer)]
    works = dist.batch_isend_irecv(ops)
    works[0].wait()
    return [len(works), hasattr(works[0], "source_rank"), into[0].tolist(), into[1].tolist(),
            ops_for_rank]


def _one_work_per_batch(switch_off: bool) -> list:
    if switch_off:
        nccl_semantics.uninstall()
    return _exchange(nccl_semantics.installed())


def test_a_batch_answers_with_one_work_that_covers_it_and_gloo_with_one_per_op() -> None:
    emulated = run_on_ranks(_one_work_per_batch, world_size=2, args=(False,), timeout_s=60)
    plain = run_on_ranks(_one_work_per_batch, world_size=2, args=(True,), timeout_s=60)
    for rank, (works, source_rank, first, second, installed) in enumerate(emulated):
        peer = 1 - rank
        assert (works, source_rank, installed) == (1, False, True)
        # waiting on the one work completed every receive of the batch
        assert (first, second) == ([peer] * 3, [peer * 10] * 3)
    assert [(result[0], result[4]) for result in plain] == [(4, False), (4, False)]


def _partial_first_batch(warm_up: bool) -> str:
    from megatron_rlhf.runtime.distributed import new_member_group

    rank = dist.get_rank()
    if warm_up:
        group = new_member_group([0, 1, 2], 3.0, "three")
    else:
        group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=3))
    if rank == 2:  # a member with nothing to move in this transfer
        time.sleep(4)
        return "idle"
    tensor = torch.ones(2) if rank == 0 else torch.empty(2)
    op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, tensor, 1 - rank, group=group)
    try:
        dist.batch_isend_irecv([op])[0].wait()
    except nccl_semantics.FreshGroupPartialBatch as error:
        return str(error)
    return f"moved {tensor.tolist()}"


def test_the_first_batch_on_a_fresh_group_must_involve_every_member() -> None:
    fresh = run_on_ranks(_partial_first_batch, world_size=3, args=(False,), timeout_s=60)
    for message in fresh[:2]:
        assert "ranks [2] did not post" in message and "group [0, 1, 2]" in message
    # after a collective over the whole group, a batch between two of its members is allowed
    warmed = run_on_ranks(_partial_first_batch, world_size=3, args=(True,), timeout_s=60)
    assert warmed == ["moved [1.0, 1.0]", "moved [1.0, 1.0]", "idle"]


def _late_receiver(receiver_delay_s: float) -> dict:
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    dist.barrier(group=group)
    tensor = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    if rank == 1:
        time.sleep(receiver_delay_s)
    op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, tensor, 1 - rank, group=group)
    posted = time.monotonic()
    outcome = {"rank": rank}
    try:
        work = dist.batch_isend_irecv([op])[0]
        if rank == 0:
            time.sleep(receiver_delay_s + 0.5)  # the sender computes, its send in flight
        work.wait()
        outcome["error"] = None
    except nccl_semantics.WatchdogTimeout as error:
        outcome["error"] = str(error)
        outcome["failed_after_s"] = time.monotonic() - posted
        try:
            dist.batch_isend_irecv([op])
        except dist.DistBackendError as aborted:
            outcome["later"] = str(aborted)
        time.sleep(1.0)  # the receiver posts late into a live process
    except RuntimeError as error:  # the receiver meets a communicator its peer aborted
        outcome["error"] = str(error)
    return outcome


def test_the_watchdog_counts_from_the_post_and_aborts_the_group() -> None:
    # The receiver posts 3 s after the send, past the group's 2 s: gloo, which counts from the
    # wait, would deliver; NCCL's watchdog has failed the send by then.
    sender, _ = run_on_ranks(_late_receiver, world_size=2, args=(3.0,), timeout_s=60)
    assert "Watchdog caught collective operation timeout" in sender["error"]
    assert "OpType=COALESCED, sends=1, recvs=0" in sender["error"]
    assert 1.9 < sender["failed_after_s"] < 4.5
    assert "was aborted by the watchdog" in sender["later"]
    # within the timeout the same exchange completes
    on_time = run_on_ranks(_late_receiver, world_size=2, args=(0.5,), timeout_s=60)
    assert [outcome["error"] for outcome in on_time] == [None, None]


def _groups_in_rank_order() -> str:
    rank = dist.get_rank()
    first, second = ([0, 1], [1, 2]) if rank != 2 else ([1, 2], [0, 1])
    dist.new_group(first)
    dist.new_group(second)
    return "created"


def test_ranks_that_create_groups_in_different_orders_are_stopped_at_the_call() -> None:
    with pytest.raises(Exception, match=r"(?s)GroupOrderMismatch.*creation #0 .* has members \[1, 2\] on rank 2 but "
                                        r"\[0, 1\] on rank 0"):
        run_on_ranks(_groups_in_rank_order, world_size=3, timeout_s=30)


def _split_and_defaults() -> dict:
    before = nccl_semantics.group_calls()
    mine = dist.split_group(split_ranks=[[0, 1], [2, 3]], group_desc="pairs")
    plain = dist.new_group([0, 1, 2, 3])
    timeout = plain._get_backend(torch.device("cpu")).options._timeout
    total = torch.ones(1)
    dist.all_reduce(total, group=mine)
    return {"members": dist.get_process_group_ranks(mine), "sum": total.item(),
            "calls": nccl_semantics.group_calls() - before, "timeout_s": timeout.total_seconds(),
            "split_supported": supports_split_group()}


def test_split_group_runs_on_gloo_and_groups_get_nccls_default_timeout() -> None:
    results = run_on_ranks(_split_and_defaults, world_size=4, timeout_s=60)
    assert [r["members"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["sum"] == 2.0 and r["calls"] == 3 and r["split_supported"] for r in results)
    assert all(r["timeout_s"] == 600.0 for r in results)
