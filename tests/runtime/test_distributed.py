"""Joining the job on a GPU machine, checked on CPU by recording what torch is asked to do."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.runtime.distributed import DistributedConfig, init_distributed


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """A pretend CUDA machine whose init_process_group call is recorded, not made."""
    calls: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(set_device=device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.update(kwargs))
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    return calls


def test_nccl_binds_the_local_gpu_and_raises_on_failure(recorded: dict) -> None:
    init_distributed(DistributedConfig(backend="auto", timeout_s=30))
    assert recorded["backend"] == "nccl"
    assert recorded["device_id"] == torch.device("cuda", 3)
    assert recorded["set_device"] == torch.device("cuda", 3)
    assert recorded["timeout"].total_seconds() == 30
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_an_explicit_nccl_error_handling_setting_is_kept(recorded: dict, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    init_distributed(DistributedConfig(backend="nccl"))
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_gloo_on_a_gpu_machine_gets_no_device_binding(recorded: dict) -> None:
    init_distributed(DistributedConfig(backend="gloo"))
    assert recorded["backend"] == "gloo"
    assert "device_id" not in recorded
    assert recorded["set_device"] == torch.device("cuda", 3)

