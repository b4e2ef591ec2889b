"""Row transfers between model layouts: the pure planner, and its execution on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.transfer import RowLayout, Transfer, plan_transfers
from tests.multirank import run_on_ranks


def _rows_received(plan: list[Transfer], rank: int) -> list[int]:
    return sorted(row for t in plan if t.dst == rank for row in range(t.start, t.end))


def test_every_needed_row_arrives_exactly_once_from_a_holder() -> None:
    source = RowLayout.sharded(12, [[0, 1], [2, 3]])  # a TP2 x DP2 model's outputs
    target = RowLayout.sharded(12, [[4], [5], [6]])  # a DP3 model on other ranks
    plan = plan_transfers(source, target)
    for rank, (start, end) in target.rows.items():
        assert _rows_received(plan, rank) == list(range(start, end))
    for t in plan:
        s, e = source.rows[t.src]
        assert s <= t.start and t.end <= e


def test_local_rows_are_copied_not_sent() -> None:
    source = RowLayout.sharded(8, [[0], [1]])
    target = RowLayout.replicated(8, [0, 1])
    plan = plan_transfers(source, target)
    assert Transfer(0, 0, 0, 4) in plan and Transfer(1, 1, 4, 8) in plan
    assert Transfer(1, 0, 4, 8) in plan and Transfer(0, 1, 0, 4) in plan


def test_sources_are_balanced_and_prefer_the_same_node() -> None:
    source = RowLayout.replicated(8, [0, 1, 2, 3])  # four holders of everything
    target = RowLayout.sharded(8, [[4], [5], [6], [7]])
    plan = plan_transfers(source, target)
    assert sorted(t.src for t in plan) == [0, 1, 2, 3]
    node_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}.__getitem__
    near = plan_transfers(RowLayout.replicated(8, [0, 1, 2, 3]),
                          RowLayout.replicated(8, [4]), node_of=node_of)
    assert {t.src for t in near} == {2}


def test_unheld_rows_and_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="held by no rank"):
        plan_transfers(RowLayout(8, {0: (0, 4)}), RowLayout.replicated(8, [1]))
    with pytest.raises(ValueError, match="does not split"):
        RowLayout.sharded(7, [[0], [1]])
    with pytest.raises(ValueError, match="outside a batch"):
        RowLayout(4, {0: (2, 6)})


def _move_between_models() -> list[float]:
    from megatron_rlhf.engine.execution.transfer import execute_transfers

    rank = dist.get_rank()
    full = {"ids": torch.arange(24).view(8, 3), "score": torch.linspace(0, 1, 8)}
    schema = {"ids": (torch.int64, (3,)), "score": (torch.float32, ())}
    source = RowLayout.sharded(8, [[0, 1], [2, 3]])  # outputs of a TP2 x DP2 model
    target = RowLayout.sharded(8, [[3], [2], [1], [0]])  # a DP4 model, replicas reversed
    held = source.held_by(rank)
    mine = {k: v[held[0]:held[1]] for k, v in full.items()}
    # A model computing in bf16 may hold a field in a narrower dtype than the schema's: the
    # sender converts, or the receiver would read half a buffer of misinterpreted bytes.
    mine["score"] = mine["score"].bfloat16()
    full["score"] = full["score"].bfloat16().float()
    plan = plan_transfers(source, target)
    got = execute_transfers(plan, source, target, mine, schema)
    start, end = target.held_by(rank)
    assert torch.equal(got["ids"], full["ids"][start:end])
    assert got["score"].dtype == torch.float32
    assert torch.equal(got["score"], full["score"][start:end])
    back = execute_transfers(plan_transfers(target, RowLayout.replicated(8, [0])), target,
                             RowLayout.replicated(8, [0]), got, schema)
    return back["score"].tolist() if back is not None else []


@pytest.mark.multirank
def test_execution_moves_rows_between_layouts() -> None:
    results = run_on_ranks(_move_between_models, world_size=4, timeout_s=60)
    assert results[0] == torch.linspace(0, 1, 8).bfloat16().float().tolist()
    assert results[1:] == [[], [], []]


def _channels() -> dict:
    from megatron_rlhf.engine.execution.transfer import (
        TransferChannels,
        channel_key,
        execute_transfers,
    )

    rank = dist.get_rank()
    channels = TransferChannels([([2, 3], [0, 1]), ([0, 1], [2, 3]), ([2, 3], [0, 1, 2, 3]),
                                 ([1], [1])], timeout_s=30)
    groups = {tuple(sorted(map(tuple, map(sorted, key)))): channels.group(key)
              for key in channels.keys}
    members = {key: None if group is None or group == dist.GroupMember.NON_GROUP_MEMBER
               else dist.get_process_group_ranks(group) for key, group in groups.items()}
    schema = {"x": (torch.float32, (2,))}
    source, target = RowLayout.sharded(4, [[2], [3]]), RowLayout.replicated(4, [0, 1])
    held = source.held_by(rank)
    mine = {"x": torch.arange(8.0).view(4, 2)[held[0]:held[1]]} if held else None
    got = execute_transfers(plan_transfers(source, target), source, target, mine, schema,
                            channels)
    in_flight = channels.in_flight
    channels.drain()
    missing = None
    try:
        channels.group(channel_key([0], [3]))
    except KeyError as error:
        missing = str(error)
    return {"members": members, "got": None if got is None else got["x"].tolist(),
            "in_flight": in_flight, "after_drain": channels.in_flight, "missing": missing,
            "world": any(group == dist.group.WORLD for group in groups.values())}


@pytest.mark.multirank
def test_each_pair_of_rank_sets_has_its_own_group_and_sends_stay_in_flight_there() -> None:
    results = run_on_ranks(_channels, world_size=4, timeout_s=60)
    members = results[0]["members"]
    assert sorted(members) == [((0, 1), (2, 3)), ((0, 1, 2, 3), (2, 3)), ((1,),)]
    assert results[2]["members"][((0, 1), (2, 3))] == [0, 1, 2, 3]  # same ranks, own group
    assert results[2]["members"][((0, 1, 2, 3), (2, 3))] == [0, 1, 2, 3]
    assert results[0]["members"][((1,),)] is None  # one rank: local copies only
    assert not any(result["world"] for result in results)
    expected = torch.arange(8.0).view(4, 2).tolist()
    assert [result["got"] for result in results] == [expected, expected, None, None]
    # Ranks 2 and 3 each sent their two rows to ranks 0 and 1 in one batch and went on.
    assert [result["in_flight"] for result in results] == [0, 0, 1, 1]  # one batch each
    assert all(result["after_drain"] == 0 for result in results)
    assert "no transfer channel between ranks [0] and [3]" in results[0]["missing"]


def _long_generation() -> dict:
    import datetime
    import time

    from megatron_rlhf.config.ppo_run import ModelsConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.execution.workers import ModelWorker
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.runtime.patches import default_group_store
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.placement_config import PlacementConfig

    # A world whose collectives (and gloo's point-to-point receives) time out after 3 s.
    store, rank, world_size = default_group_store(), dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("short-timeout", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=3))
    initialize_runtime()
    config = RunConfig(placement=PlacementConfig(strategy="separation"),
                       models=ModelsConfig(arch="tiny", init_seed=4),
                       rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=8,
                                             micro_batch_size=1, num_minibatches=1,
                                             pipeline_chunks=2),
                       generation=GenerationConfig(max_new_tokens=4, seed=2), steps=1)
    engine = build_engine(config, make_plan(config, cluster_from_environment()), 3, 0)
    generate = ModelWorker.generate

    def slow_generate(self, *args, **kwargs):
        time.sleep(5)  # a generation stage longer than the world's collective timeout
        return generate(self, *args, **kwargs)

    ModelWorker.generate = slow_generate
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=3,
                             prompts=lambda step: (prompts, [0, 1, 2, 3]), total_steps=1)
    metrics = algorithm.step(0)
    return {"roles": sorted(engine.workers), "reward_mean": metrics["reward_mean"]}


@pytest.mark.multirank
def test_a_stage_longer_than_the_world_timeout_completes_on_the_transfer_channels() -> None:
    """Trainers wait for the rollout through 2 x 5 s of generation with a 3 s world timeout:
    on the world group their receives timed out; the channels have their own timeout."""
    results = run_on_ranks(_long_generation, world_size=4, timeout_s=240)
    assert "actor" in results[0]["roles"] and "actor" not in results[3]["roles"]
    assert len({result["reward_mean"] for result in results}) == 1


def _late_side(late: str, timeout_s: float, late_s: float) -> dict:
    import time

    from megatron_rlhf.engine.execution.transfer import TransferChannels, execute_transfers

    rank = dist.get_rank()
    # The groups' timeout (NCCL's watchdog) is short; the waits for a peer's readiness are not.
    channels = TransferChannels([([2, 3], [0, 1])], timeout_s=timeout_s, ready_timeout_s=30)
    posted: list[float] = []
    batch = dist.batch_isend_irecv

    def timed(ops):
        posted.append(time.time())
        return batch(ops)

    dist.batch_isend_irecv = timed
    source, target = RowLayout.sharded(4, [[2], [3]]), RowLayout.replicated(4, [0, 1])
    held = source.held_by(rank)
    if (late == "senders") == bool(held):
        time.sleep(late_s)  # this side's stage: the other side reaches the transfer first
    arrived = time.time()
    mine = {"x": torch.arange(8.0).view(4, 2)[held[0]:held[1]]} if held else None
    got = execute_transfers(plan_transfers(source, target), source, target, mine,
                            {"x": (torch.float32, (2,))}, channels)
    returned = time.time() - arrived
    channels.drain()
    dist.batch_isend_irecv = batch
    return {"arrived": arrived, "posted": posted[0], "returned_s": returned,
            "got": None if got is None else got["x"].tolist()}


@pytest.mark.multirank
@pytest.mark.timeout(90)
@pytest.mark.parametrize("late", ["senders", "receivers"])
def test_neither_side_posts_before_the_other_reaches_the_transfer(late: str) -> None:
    """Senders 2, 3 and receivers 0, 1: one side reaches the transfer 3 s after the other, on
    channels whose groups time out after 2 s. Nobody posts before the late side arrives, so the
    emulated watchdog (2 s from a post) kills no one; senders that posted at once (as they did)
    were killed while their receivers were late. Senders return at once either way."""
    results = run_on_ranks(_late_side, world_size=4, args=(late, 2.0, 3.0), timeout_s=60)
    expected = torch.arange(8.0).view(4, 2).tolist()
    assert [result["got"] for result in results] == [expected, expected, None, None]
    last = max(result["arrived"] for result in results)
    assert min(result["posted"] for result in results) >= last - 0.05, results
    assert max(result["posted"] for result in results) <= last + 1.0, results
    assert all(result["returned_s"] < 0.5 for result in results[2:]), results


def _sender_raises() -> dict:
    import time

    from megatron_rlhf.engine.execution.transfer import TransferChannels, execute_transfers
    from megatron_rlhf.runtime.faults import FaultConfig, install_fault_tracker

    tracker = install_fault_tracker(FaultConfig(grace_s=0.5), timeout_s=30)
    channels = TransferChannels([([1], [0])], timeout_s=60, stopped=tracker.stopped_ranks,
                                poll_s=0.2)
    source, target = RowLayout.replicated(2, [1]), RowLayout.replicated(2, [0])
    start = time.monotonic()
    try:
        with tracker.stage("experience/reward"):
            if dist.get_rank() == 1:
                raise ValueError("the reward function cannot grade this row")
            execute_transfers(plan_transfers(source, target), source, target, None,
                              {"x": (torch.float32, (2,))}, channels)
    except Exception as error:  # noqa: BLE001 - what each rank stopped with is the result
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_receiver_stops_soon_when_its_sender_raised_before_the_transfer() -> None:
    """A store wait does not end when the sender dies: without the look at the fault records the
    receiver would wait the channels' whole timeout (60 s here, 30 min by default)."""
    waiting, raising = run_on_ranks(_sender_raises, world_size=2, timeout_s=60)
    assert raising["error"] == "ValueError: the reward function cannot grade this row"
    assert waiting["error"].startswith("RankFailure: rank 1 raised ValueError: the reward "
                                       "function cannot grade this row"), waiting["error"]
    assert waiting["seconds"] < 10


def _receiver_raises() -> dict:
    import time

    from megatron_rlhf.engine.execution.transfer import TransferChannels, execute_transfers
    from megatron_rlhf.runtime.faults import FaultConfig, install_fault_tracker

    tracker = install_fault_tracker(FaultConfig(grace_s=0.5), timeout_s=30)
    channels = TransferChannels([([0], [1])], timeout_s=60, stopped=tracker.stopped_ranks,
                                poll_s=0.2)
    source, target = RowLayout.replicated(2, [0]), RowLayout.replicated(2, [1])
    start = time.monotonic()
    try:
        with tracker.stage("experience/transfer"):
            if dist.get_rank() == 1:  # not rank 0, which hosts the store
                raise ValueError("the trainer ran out of memory")
            execute_transfers(plan_transfers(source, target), source, target,
                              {"x": torch.ones(2, 2)}, {"x": (torch.float32, (2,))}, channels)
            channels.drain()
    except Exception as error:  # noqa: BLE001 - what each rank stopped with is the result
        seconds = time.monotonic() - start
        if dist.get_rank() == 1:
            time.sleep(12)  # alive (its connections open) until the launcher would stop it
        return {"error": f"{type(error).__name__}: {error}", "seconds": seconds}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_sender_stops_soon_when_its_receiver_raised_before_the_transfer() -> None:
    """The sender's batch waits for a receiver that will never post: it stops on the fault
    records within seconds. A send posted at once waited for the receiver's end (12 s later
    here) or the group's timeout (60 s)."""
    waiting, raising = run_on_ranks(_receiver_raises, world_size=2, timeout_s=60)
    assert raising["error"] == "ValueError: the trainer ran out of memory"
    assert waiting["error"].startswith("RankFailure: rank 1 raised ValueError: the trainer "
                                       "ran out of memory"), waiting["error"]
    assert waiting["seconds"] < 10


def _sender_goes_on() -> dict:
    import time

    from megatron_rlhf.engine.execution.transfer import TransferChannels, execute_transfers

    rank = dist.get_rank()
    channels = TransferChannels([([0], [1])], timeout_s=30)
    source, target = RowLayout.replicated(2, [0]), RowLayout.replicated(2, [1])
    schema = {"x": (torch.float32, (3,))}
    plan = plan_transfers(source, target)
    if rank == 1:
        time.sleep(2.0)  # the receiver is still busy (training) while both chunks are sent
    start, got, in_flight = time.monotonic(), [], []
    for chunk in range(2):
        rows = {"x": torch.full((2, 3), float(chunk))} if rank == 0 else None
        out = execute_transfers(plan, source, target, rows, schema, channels)
        got.append(None if out is None else out["x"].tolist())
        in_flight.append(channels.in_flight)
    sent_s = time.monotonic() - start
    channels.drain()
    after_drain = channels.in_flight
    threads_before = _channel_threads()
    channels.close()
    return {"sent_s": sent_s, "got": got, "in_flight": in_flight, "after_drain": after_drain,
            "threads": [threads_before, _channel_threads()]}


def _channel_threads() -> int:
    import threading

    return sum(thread.name == "transfer-sends" for thread in threading.enumerate())


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_second_transfer_on_a_channel_does_not_wait_for_the_first_one_to_be_received() -> None:
    """Under NCCL a wait on an earlier send would make the sender's compute stream wait for a
    receiver still training: the second chunk is posted without waiting for the first."""
    sender, receiver = run_on_ranks(_sender_goes_on, world_size=2, timeout_s=60)
    assert sender["sent_s"] < 1.5 and sender["in_flight"] == [1, 2], sender
    assert sender["after_drain"] == 0
    # A move closes the channels: their thread ends with them instead of leaking once per move.
    assert sender["threads"] == [1, 0] and receiver["threads"] == [0, 0]
    assert receiver["got"] == [[[0.0] * 3] * 2, [[1.0] * 3] * 2]
