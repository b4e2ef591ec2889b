"""Where this rank's tensors live: its compute device, and the device its collectives take.

    device = compute_device()                     # cuda:LOCAL_RANK with CUDA, else cpu
    fields = to_device(fields, device)            # one batch of named tensors, moved once
    buffer = torch.empty(n, device=comm_device()) # what the default group's backend accepts

Two devices, because the backend decides what a collective accepts: NCCL takes CUDA tensors only,
gloo takes CPU tensors (its CUDA support covers few collectives and no point-to-point). On a GPU
machine under NCCL both are this rank's GPU; on CPU both are the CPU; a GPU job forced onto gloo
computes on the GPU and stages its transfers through host memory. The engine moves a batch to the
compute device in one place (the model worker) and to the communication device in one place (the
transfer), so no call site guesses.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


def compute_device() -> torch.device:
    """This rank's accelerator (the current CUDA device), or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend (default: the world's) sends and reduces."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (they are all on one device once built)."""
    return next(model.parameters()).device


def to_device(fields: Mapping[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """The same named tensors on ``device`` (tensors already there are not copied).

    Copies onto a GPU do not block the host (torch orders them before any kernel of the current
    stream that reads the result); copies to the host do, since the host reads them next.
    """
    non_blocking = device.type == "cuda"
    return {name: tensor.to(device, non_blocking=non_blocking) for name, tensor in fields.items()}
