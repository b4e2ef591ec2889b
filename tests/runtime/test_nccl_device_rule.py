"""NCCL's device rule on CPU: tensors a GPU run would hold in host memory are marked where this
package makes them, and a collective or P2P that gets one fails, naming both places."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.testing import nccl_device_rule
from megatron_rlhf.testing.nccl_device_rule import HostTensorInCollective, host_made_at
from tests.multirank import run_on_ranks

PROBE = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    from megatron_rlhf.runtime.device import comm_device, compute_device

    def totals_made_on_the_host(sums):
        # The pattern the throughput metrics had: a float64 list all-reduced on the world.
        totals = torch.tensor(sums, dtype=torch.float64)
        dist.all_reduce(totals, group=dist.group.WORLD)
        return totals.tolist()

    def totals_made_on_the_comm_device(sums):
        totals = torch.tensor(sums, dtype=torch.float64, device=comm_device())
        dist.all_reduce(totals, group=dist.group.WORLD)
        return totals.tolist()

    def made(kind):
        device_tensor = torch.ones(4, device=compute_device())
        return {
            "tensor": torch.tensor([1.0, 2.0]),
            "zeros_cpu": torch.zeros(2, device="cpu"),
            "zeros_device": torch.zeros(2, device=compute_device()),
            "cpu_of_device": device_tensor.cpu(),
            "device_after_cpu": device_tensor,
            "moved": torch.arange(3).to(compute_device()),
            "cast": torch.arange(3).double(),
            "stacked": torch.stack([torch.tensor(1.0), torch.tensor(2.0)]),
            "mixed": torch.arange(4.0) + device_tensor,
            "like": torch.zeros_like(device_tensor),
        }[kind]

    def sent_from_the_host(peer):
        payload = torch.ones(3, device=comm_device()).cpu()
        ops = [dist.P2POp(dist.isend if dist.get_rank() == 0 else dist.irecv, payload, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
""")
"""Code that runs as this package's own (the rule looks only at the package's calls)."""


def _probe() -> types.ModuleType:
    module = types.ModuleType("megatron_rlhf.engine.device_rule_probe")
    exec(compile(PROBE, "device_rule_probe.py", "exec"), module.__dict__)  # noqa: S102
    return module


@pytest.fixture
def rule():
    installed = nccl_device_rule.installed()
    nccl_device_rule.install()
    yield _probe()
    if not installed:
        nccl_device_rule.uninstall()


@pytest.mark.parametrize("kind", ["tensor", "zeros_cpu", "cpu_of_device", "cast", "stacked"])
def test_what_a_gpu_run_holds_in_host_memory_is_marked_where_it_is_made(rule, kind) -> None:
    assert host_made_at(rule.made(kind)).startswith("device_rule_probe.py:")


@pytest.mark.parametrize("kind", ["zeros_device", "device_after_cpu", "moved", "mixed", "like"])
def test_device_tensors_and_moves_to_the_device_are_not_marked(rule, kind) -> None:
    assert host_made_at(rule.made(kind)) is None


def test_only_this_packages_calls_mark_tensors(rule) -> None:
    # The test module is not the package: torch's and megatron-core's allocations (and the
    # tests' own) follow their GPU code paths and stay unmarked.
    assert host_made_at(torch.tensor([1.0])) is None
    assert host_made_at(torch.nn.Linear(2, 2).weight) is None


def _collectives(kind: str):
    probe = _probe()
    try:
        if kind == "host":
            return probe.totals_made_on_the_host([1.0, float(dist.get_rank())])
        if kind == "device":
            # Every rank the suite starts runs under NCCL's semantics, the rule among them.
            return (nccl_device_rule.installed(),
                    probe.totals_made_on_the_comm_device([1.0, float(dist.get_rank())]))
        if kind == "p2p":
            return probe.sent_from_the_host(1 - dist.get_rank())
        # Objects are pickled: host tensors inside them are fine under NCCL too.
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"t": probe.made("tensor")})
        return [g["t"].tolist() for g in gathered]
    except HostTensorInCollective as error:
        return str(error)


@pytest.mark.multirank
def test_a_host_tensor_all_reduced_on_the_world_fails_naming_both_lines() -> None:
    results = run_on_ranks(_collectives, world_size=2, args=("host",), timeout_s=60)
    for message in results:
        assert "all_reduce at device_rule_probe.py:10" in message
        assert "made in host memory at device_rule_probe.py:9 (tensor)" in message
        assert "comm_device" in message


@pytest.mark.multirank
def test_tensors_on_the_comm_device_and_pickled_objects_pass() -> None:
    assert run_on_ranks(_collectives, world_size=2, args=("device",), timeout_s=60) == [
        (True, [2.0, 1.0])] * 2
    assert run_on_ranks(_collectives, world_size=2, args=("objects",), timeout_s=60) == [
        [[1.0, 2.0], [1.0, 2.0]]] * 2


@pytest.mark.multirank
def test_a_batched_p2p_of_a_host_copy_fails() -> None:
    results = run_on_ranks(_collectives, world_size=2, args=("p2p",), timeout_s=60)
    assert all("batch_isend_irecv at device_rule_probe.py" in message and "(cpu)" in message
               for message in results)
