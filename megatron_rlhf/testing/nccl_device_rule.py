"""NCCL's device rule on a CPU-only torch: a collective refuses a tensor that a GPU run would
hold in host memory.

A process group made with backend ``nccl`` maps only the ``cuda`` device type, so a host tensor
handed to one of its collectives or point-to-point operations raises ``No backend type
associated with device type cpu`` on every GPU run. On CPU every tensor is a host tensor and
gloo takes them all, so the suite cannot see the mistake unless something remembers which
tensors *would* be host tensors on a GPU. This module does, as part of the NCCL-semantics test
mode (:mod:`~megatron_rlhf.testing.nccl_semantics`, which installs it; it never runs in
production):

* A tensor becomes **host-made** where a GPU run would put it in host memory: a factory
  (``torch.tensor``, ``torch.zeros``, ``torch.arange``, ...) called without a device or with the
  device string ``"cpu"``, ``tensor.cpu()`` and ``tensor.to("cpu")``. Only calls made from this
  package count: megatron-core's and torch's own allocations follow their GPU code paths.
* It stays host-made through every operation whose tensor inputs are all host-made (a dtype
  cast, a view, ``torch.stack`` of host scalars), and a move to a ``torch.device`` (the compute
  or communication device, on CPU ``cpu`` as well) or to ``"cuda"`` gives a tensor that is not.
* :func:`check_collective` raises :class:`HostTensorInCollective` when a host-made tensor reaches
  a collective or point-to-point operation, naming the file and line of the call and of the
  tensor's making.

The rule is heuristic where CPU cannot tell: ``torch.device("cpu")`` written out in the code
counts as the device (it is indistinguishable from ``comm_device()`` here), and
``torch.from_numpy`` is not seen (it does not reach torch function modes). Inside
``generate_sequences`` no tensor is marked by default: the mode is left there with the
CUDA-to-CPU one (``runtime.patches.cuda_redirect_suspended``), as generation would run at half
speed. The tests that run generation's own collectives (the expert lockstep, the TP ranks'
weight hand-over check) set :data:`IN_GENERATION_ENV`, which keeps marking there. On a machine
with CUDA the rule is not installed: there a gloo world really takes host tensors.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

IN_GENERATION_ENV = "MEGATRON_RLHF_DEVICE_RULE_IN_GENERATION"
"""``1``: tensors are marked inside ``generate_sequences`` too (the mode stays entered there,
and so does the CUDA-to-CPU one below it), for the tests of collectives that run during
generation."""

_SITE = "_megatron_rlhf_host_made_at"
"""The attribute a host-made tensor carries: where it was made, ``file:line (function)``."""

_PACKAGE = "megatron_rlhf."
_NOT_CALLERS = ("megatron_rlhf.runtime.cpu_compat", "megatron_rlhf.testing.nccl_device_rule",
                "megatron_rlhf.testing.nccl_semantics")
"""This package's modules that only relay another caller's torch calls."""

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty,
    torch.full, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.empty_strided, torch.scalar_tensor,
})
"""Functions that make a tensor from no tensor: where the device argument decides."""


class HostTensorInCollective(RuntimeError):
    """A collective or point-to-point operation got a tensor that would be in host memory on a
    GPU, where NCCL refuses it."""


def host_made_at(tensor: torch.Tensor) -> str | None:
    """Where ``tensor`` was made in host memory (``file:line (function)``), or None."""
    return getattr(tensor, _SITE, None)


def _site(frame: FrameType, what: str) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({what})"


def _project_caller(frame: FrameType | None) -> FrameType | None:
    """The frame of this package's code that made the torch call seen in ``frame``'s callee, or
    None when torch, megatron-core or another library made it."""
    while frame is not None and frame.f_globals.get("__name__", "") in _NOT_CALLERS:
        frame = frame.f_back
    if frame is None or not frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        return None
    return frame


def _is_host_device(device: Any) -> bool | None:
    """True for a device argument that means host memory on a GPU run (``"cpu"``), False for one
    that means the GPU, None for no device argument."""
    if device is None:
        return None
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    return False


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _mark(result: Any, site: str | None) -> Any:
    if isinstance(result, torch.Tensor):
        setattr(result, _SITE, site)
    elif isinstance(result, (list, tuple)):
        for item in result:
            if isinstance(item, torch.Tensor):
                setattr(item, _SITE, site)
    return result


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object over the same storage: on CPU a move to the same device returns its
    input, where a GPU run would return a new tensor on the other side."""
    return tensor.view_as(tensor) if tensor.requires_grad else tensor.detach()


class HostTensorMode(TorchFunctionMode):
    """Marks the tensors a GPU run would hold in host memory (see the module docstring)."""

    suspended_in_generation = True
    """Left with the CUDA-to-CPU mode while a model generates (``torch.compile`` of the decode
    step cannot trace a mode, and generation would run at half speed)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.cpu or func is torch.Tensor.to:
            return self._moved(func, args, kwargs, result)
        device = kwargs.get("device")
        if device is None and func not in FACTORIES:
            return self._propagate(args, result)
        if device is not None and not _is_host_device(device):
            return result
        caller = _project_caller(sys._getframe(1))
        return result if caller is None else _mark(result, _site(caller, func.__name__))

    @staticmethod
    def _propagate(args: tuple, result: Any) -> Any:
        sites = [host_made_at(tensor) for tensor in _tensors(args)]
        if sites and all(sites):
            return _mark(result, sites[0])
        return result

    @staticmethod
    def _moved(func, args: tuple, kwargs: dict, result: torch.Tensor) -> torch.Tensor:
        """``tensor.cpu()`` or ``tensor.to(...)``: host-made after a move to ``"cpu"``, not
        host-made after a move to a device; a dtype cast keeps what its input was."""
        source = args[0]
        made_at = host_made_at(source)
        if func is torch.Tensor.cpu:
            host = True
        else:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, torch.Tensor):
                host = host_made_at(target) is not None
            elif isinstance(target, (str, torch.device)):
                host = bool(_is_host_device(target))
            else:
                host = made_at is not None
        caller = _project_caller(sys._getframe(2))
        if caller is None:
            host = made_at is not None
        if host:
            if result is source:
                return result if made_at else _mark(_alias(result), _site(caller, "cpu"))
            return _mark(result, made_at or _site(caller, func.__name__))
        return _alias(result) if result is source and made_at else result


_mode: HostTensorMode | None = None


def install() -> None:
    """Start marking host-made tensors in this thread (idempotent; nothing with CUDA)."""
    global _mode
    if _mode is None and not torch.cuda.is_available():
        _mode = HostTensorMode()
        if os.environ.get(IN_GENERATION_ENV, "0") not in ("", "0"):
            _mode.suspended_in_generation = False
        _mode.__enter__()


def uninstall() -> None:
    """Stop marking; modes entered after this one (the CUDA-to-CPU one) stay entered."""
    global _mode
    if _mode is None:
        return
    stack = _get_current_function_mode_stack()
    if any(mode is _mode for mode in stack):
        above = stack[next(i for i, mode in enumerate(stack) if mode is _mode) + 1:]
        for mode in reversed(above):
            mode.__exit__(None, None, None)
        _mode.__exit__(None, None, None)
        for mode in above:
            mode.__enter__()
    _mode = None


def installed() -> bool:
    return _mode is not None


def _call_site(frame: FrameType | None) -> str:
    """The first frame outside torch and this module: where the operation was called."""
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("torch.")
                                 or frame.f_globals.get("__name__", "") in _NOT_CALLERS):
        frame = frame.f_back
    return "an unknown caller" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def check_collective(operation: str, values: Any, frame: FrameType | None) -> None:
    """Refuse host-made tensors among ``values`` (tensors, lists of tensors, ``P2POp``s) handed
    to ``operation``, called from ``frame``'s caller chain.

    Raises:
        HostTensorInCollective: naming where the operation was called and where the tensor was
            made.
    """
    if _mode is None:
        return
    if operation.endswith(("_object", "_object_list")):
        return  # objects are pickled and staged on the backend's device by torch
    if frame is not None and frame.f_globals.get("__name__", "").startswith("torch.distributed"):
        return  # torch's own staging (all_gather_object's buffers) follows the backend's device
    flat = [getattr(value, "tensor", value) for value in values]
    for tensor in _tensors(flat):
        made_at = host_made_at(tensor)
        if made_at is not None:
            raise HostTensorInCollective(
                f"[NCCL semantics] {operation} at {_call_site(frame)} gets a tensor made in host "
                f"memory at {made_at}: on GPUs the group is NCCL's, which takes CUDA tensors "
                "only ('No backend type associated with device type cpu'); make the tensor on "
                "megatron_rlhf.runtime.device.comm_device(group) (or move it there) first")
