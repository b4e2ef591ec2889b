"""Run megatron-core 0.16.1 on a machine without CUDA (CPU tensors, gloo collectives).

megatron-core assumes a GPU in a few dozen places: it allocates with ``device="cuda"`` or
``torch.cuda.current_device()``, synchronises and creates CUDA streams and events, and keeps the
dropout RNG streams (its "RNG tracker") in CUDA generator state. This module holds the CPU
stand-ins for those places; :func:`megatron_rlhf.runtime.patches.apply_cpu_compat` installs them,
only when ``torch.cuda.is_available()`` is False (a GPU run is never touched), and
``runtime.patches.PATCHES`` says which megatron code needs each.

What differs from a GPU run (also in docs/cpu.md):
  * tensors megatron asks to put "on cuda" stay on the CPU;
  * streams and events are no-ops (CPU work is synchronous);
  * the model-parallel RNG streams live in the CPU generator: :class:`CpuRNGStatesTracker` swaps the
    CPU generator state exactly where megatron's tracker swaps the CUDA one, so dropout is still
    different across TP ranks and identical across DP replicas.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mcore_random
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON_CORE_VERSION = "0.16.1"
"""The version setup.py installs and the suite runs against."""
TESTED_MEGATRON_CORE_VERSIONS = ("0.16.0", "0.16.1")
"""Versions the patches (runtime/patches.py) were checked against: 0.16.0's source differs from
0.16.1's only in a checkpoint worker's memory clean-up this project does not use, Mamba and the
version strings."""


def megatron_core_version_warning(installed: str, cuda: bool) -> str | None:
    """The gate on megatron-core ``installed``: None for a version in
    :data:`TESTED_MEGATRON_CORE_VERSIONS`; on a GPU (``cuda``) a warning naming the tested range,
    since there the CPU patches are not made; on CPU a refusal, since the CPU compatibility
    layer patches megatron-core's internals.

    Raises:
        RuntimeError: on CPU, naming the installed and the tested versions and the install
            command.
    """
    if installed in TESTED_MEGATRON_CORE_VERSIONS:
        return None
    message = (f"megatron-core {installed} is installed but megatron_rlhf is tested with "
               f"{', '.join(TESTED_MEGATRON_CORE_VERSIONS)}")
    if cuda:
        return f"{message}; its private APIs used here (runtime/patches.py) may have changed"
    raise RuntimeError(f"{message}, and on CPU it patches megatron-core's internals: run "
                       f"`pip install megatron-core=={SUPPORTED_MEGATRON_CORE_VERSION}`")


def check_megatron_core_version() -> None:
    """:func:`megatron_core_version_warning` on the installed megatron-core and this machine."""
    from megatron.core import package_info

    warning = megatron_core_version_warning(package_info.__version__, torch.cuda.is_available())
    if warning:
        warnings.warn(warning, stacklevel=2)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "CUDA device index" to torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Turns every request for a CUDA tensor into a CPU tensor.

    Needed for the literal ``device="cuda"`` allocations and ``.cuda()`` calls spread through
    megatron-core (pipeline schedules' token counters, optimizer found-inf flags, gradient
    clipping, default causal masks, checkpoint exchange buffers, ...).
    """

    suspended_in_generation = True
    """Left by ``patches.cuda_redirect_suspended`` while a model generates."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _tensor_type_name(args[0], caller=_caller(sys._getframe(1)))
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _caller(frame: FrameType) -> FrameType:
    """The frame that made a torch call, past other torch function modes relaying it (the
    NCCL-semantics test mode's sits above this one)."""
    while frame.f_code.co_name == "__torch_function__" and frame.f_back is not None:
        frame = frame.f_back
    return frame


def _tensor_type_name(tensor: torch.Tensor, caller: FrameType) -> str:
    """``tensor.type()``, with CUDA names for megatron's optimizers.

    megatron's (distributed) optimizers sort parameters by ``param.type()`` and accept only
    ``torch.cuda.*Tensor`` names. Only callers inside ``megatron.core.optimizer`` get the CUDA
    name; everything else sees the true CPU name.
    """
    name = torch.Tensor.type(tensor)
    if caller.f_globals.get("__name__", "").startswith("megatron.core.optimizer"):
        return name.replace("torch.", "torch.cuda.", 1)
    return name


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoOpEvent:
        return event or _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpEvent:
    """Stands in for ``torch.cuda.Event``; timing falls back to the host clock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._time = 0.0

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _NoOpEvent) -> float:
        return (end._time - self._time) * 1000.0


_DEFAULT_STREAM = _NoOpStream()


def cuda_replacements() -> dict[str, Any]:
    """CPU meanings of ``torch.cuda``'s device, stream, memory and RNG functions, by name.

    ``torch.cuda.is_available()`` is not among them: torch itself and megatron's feature checks
    still see a machine without CUDA.
    """
    return {
        "current_device": lambda: "cpu",
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "Stream": _NoOpStream,
        "Event": _NoOpEvent,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    }


def megatron_rng_replacements() -> dict[str, Any]:
    """CPU versions of the two helpers of ``megatron.core.tensor_parallel.random`` that save and
    restore "the CUDA RNG state" (activation recomputation replays dropout with them)."""
    return {
        "_get_cuda_rng_state":
            lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
        "_set_cuda_rng_state":
            lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
    }


def moe_split_sizes_to_host(tensor: Any, as_numpy: bool = False,
                            record_stream: bool = False) -> Any:
    """CPU version of megatron's ``moe_utils.maybe_move_tensor_to_cpu`` for its token dispatcher.

    The all-to-all dispatcher copies its per-rank token counts "to the host" before passing them
    as ``all_to_all_single``'s split sizes; megatron's helper converts only CUDA tensors, so on
    CPU the counts stay tensors, which the collective refuses. Here every tensor is copied (the
    dispatcher keeps using the originals) and, with ``as_numpy``, made a numpy array, as the GPU
    path does.
    """
    if not torch.is_tensor(tensor):
        return tensor
    copy = tensor.detach().clone()
    return copy.numpy() if as_numpy else copy


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron's RNG tracker with the CPU generator in place of the CUDA one.

    ``fork(name)`` swaps the process's CPU generator to the named stream and back, which is what
    megatron's tracker does with the CUDA generator; dropout inside tensor-parallel regions
    therefore draws from a per-TP-rank stream, as on GPU.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked; seed it first")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def seed_model_parallel_rng(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Seed megatron's model-parallel RNG streams for this rank, on CPU or GPU.

    Uses megatron's own seed layout (``model_parallel_cuda_manual_seed``): the default stream gets
    ``seed``, the tensor-parallel stream ``seed + 2718 + tp_rank``.
    """
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    if isinstance(tracker, CpuRNGStatesTracker):  # installed by patches.apply_cpu_compat
        tracker.reset()
        tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
        tracker.add(
            mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank
        )
        return
    mcore_random.model_parallel_cuda_manual_seed(
        seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank, force_reset_rng=True
    )
