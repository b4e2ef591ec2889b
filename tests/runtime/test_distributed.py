"""Joining the job on a GPU machine, checked on CPU by recording what torch is asked to do."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.runtime.distributed import (
    DistributedConfig,
    init_distributed,
    launched_without_torchrun,
    local_device_index,
)


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """A pretend CUDA machine whose init_process_group call is recorded, not made."""
    calls: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
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



def test_a_process_that_sees_one_gpu_uses_it_and_too_few_gpus_are_named(monkeypatch) -> None:
    assert local_device_index(3, 8) == 3
    assert local_device_index(3, 1) == 0  # srun --gpus-per-task=1: each task sees its own GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3 but this process sees 2 GPUs "
                       r"\(CUDA_VISIBLE_DEVICES=0,1\); start at most 2 processes per node "
                       r"\(torchrun --nproc-per-node 2\)"):
        local_device_index(3, 2)


def test_a_gpu_index_past_the_visible_ones_is_refused_before_binding(recorded: dict,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but this process sees 2 GPUs"):
        init_distributed(DistributedConfig(backend="nccl"))
    assert "set_device" not in recorded and "backend" not in recorded


@pytest.mark.parametrize("env, found", [
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, "SLURM_STEP_NUM_TASKS=8"),
    ({"SLURM_STEP_NUM_TASKS": "8"}, None),  # an salloc shell, not a task of srun
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4"),
    ({"PMI_SIZE": "2"}, "PMI_SIZE=2"),
    ({}, None),
])
def test_processes_started_without_torchrun_are_refused(monkeypatch, env: dict,
                                                        found: str | None) -> None:
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                 "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launched_without_torchrun() == found
    if found is not None:
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        with pytest.raises(ValueError, match=f"{found}: several processes were started, but "
                           "without torchrun's RANK/WORLD_SIZE each would train alone"):
            init_distributed(DistributedConfig(backend="gloo"))
        assert "RANK" not in os.environ
