"""A stand-in for ``torch.cuda.CUDAGraph`` on CPU that checks what graph capture forbids.

On CUDA the continuous decode step is captured once into a graph and replayed per token
(:class:`~megatron_rlhf.generation.decode_step.DecodeGraph`); on CPU it runs eagerly, so the
capture path (warm-up, state restore, capture, replay, re-capture after the slots shrink) would
never run in a test. With ``MEGATRON_RLHF_EMULATE_CUDA_GRAPHS=1`` (tests only; production on
CPU stays eager) ``DecodeGraph`` captures into a :class:`StandInGraph` instead:

* **capture mode**: the stand-in takes ``capture_error_mode`` as ``torch.cuda.graph`` does and
  refuses ``global``, torch's default: under it any other thread's CUDA call that capture deems
  unsafe (NCCL allocating for a transfer thread's first send to a new peer, say) breaks the
  capture. ``thread_local`` (what megatron captures with) checks the capturing thread only.
* **capture** runs the step once under :class:`_CaptureChecks` and then puts back every buffer
  it wrote, as a real capture records kernels without running them. The checks raise
  :class:`GraphCaptureError` on a host synchronisation (``.item()``, ``bool(tensor)``,
  ``.tolist()``, ``.cpu()``, ``nonzero``, ``masked_select`` and other ops whose output shape
  depends on the data) and on a tensor made from host data inside the step (``torch.tensor``:
  on CUDA a host-to-device copy, which capture refuses). They also record, op by op, the
  storage address of every tensor the step reads or writes that it did not allocate itself
  (slot buffers, KV cache, parameters, RoPE tables ...), and the op's shapes and Python scalars.
* **replay** re-runs the step (in the decoder's fixed-context mode: the whole bucket, as a
  captured step) under the same checks and raises :class:`GraphCaptureError` when an op differs
  from the captured one: a buffer the step reads or writes at another address (a CUDA graph
  would still read the old one), another shape or another Python scalar (the graph replays the
  captured value). ``watched`` names the buffers whose addresses are also compared by name,
  for a clear message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rlhf.generation.decode_step import EMULATE_GRAPHS_ENV

EMULATE_ENV = EMULATE_GRAPHS_ENV
"""Set to ``1`` to capture the continuous decode step into a :class:`StandInGraph` on CPU."""


CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
"""The values of ``torch.cuda.graph``'s ``capture_error_mode``."""


class GraphCaptureError(RuntimeError):
    """The captured step does what a CUDA graph cannot capture or replay faithfully."""


_aten = torch.ops.aten
_HOST_SYNC_OPS = {
    _aten._local_scalar_dense: "reads a value on the host (.item(), bool(tensor), int(tensor), "
                               "a Python branch on a tensor)",
    _aten.is_nonzero: "reads a value on the host (bool(tensor), a Python branch on a tensor)",
    _aten.equal: "reads a value on the host (torch.equal)",
    _aten.nonzero: "has an output shape that depends on the data (nonzero, boolean indexing)",
    _aten.masked_select: "has an output shape that depends on the data (masked_select)",
    _aten._unique2: "has an output shape that depends on the data (unique)",
    _aten.unique_dim: "has an output shape that depends on the data (unique)",
    _aten.unique_consecutive: "has an output shape that depends on the data (unique)",
    _aten.repeat_interleave: "may have an output shape that depends on the data",
}
"""Ops that stop or break a capture on CUDA, and why."""

_LIFT_OPS = {_aten.lift_fresh, _aten.lift_fresh_copy}
"""``torch.tensor(data)`` (and Python scalars wrapped as tensors, e.g. ``t[mask] = 0``): a
tensor of host data. A scalar is a kernel argument on CUDA, more is a host-to-device copy."""

_INDEX_OPS = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
"""Ops that synchronise when indexed with a boolean mask."""

_HOST_METHODS = {
    torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()", torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)", torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "a tensor used as a Python index",
}
"""Tensor methods that bring a value to the host (seen before they dispatch: ``.tolist()`` and
``.cpu()`` of a CPU tensor reach no op)."""


class _HostSyncFunctions(TorchFunctionMode):
    """Raises on the Python-level calls that move a tensor's value to the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_METHODS:
            raise GraphCaptureError(f"the captured step calls {_HOST_METHODS[func]}, a host "
                                    "synchronisation that CUDA graph capture forbids")
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _flatten(values) -> Iterator:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flatten(value)
        else:
            yield value


def _data_dependent_index(func, args) -> bool:
    """Whether an indexing op takes a boolean mask that it must turn into indices on the host.
    ``t[mask] = scalar`` does not: ``index_put_`` runs it as ``masked_fill_`` (megatron's
    vocab-parallel embedding does this under TP)."""
    masks = [i for i in _flatten(args[1:2])
             if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return False
    indices = [i for i in _flatten(args[1:2]) if i is not None]
    fill = (func.overloadpacket is not _aten.index and len(indices) == 1
            and isinstance(args[2], torch.Tensor) and args[2].dim() == 0)
    return not fill


class _CaptureChecks(TorchDispatchMode):
    """Raises on host synchronisations; records each op with the addresses of the tensors it
    reads or writes that the step did not allocate."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self._made: set[int] = set()  # storages the step allocated (addresses may be reused)
        self._outside: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNC_OPS or func.overloadpacket in _HOST_SYNC_OPS:
            why = _HOST_SYNC_OPS.get(func) or _HOST_SYNC_OPS[func.overloadpacket]
            raise GraphCaptureError(f"the captured step runs {func}, which {why}: CUDA graph "
                                    "capture forbids host synchronisation")
        if func.overloadpacket in _INDEX_OPS and _data_dependent_index(func, args):
            raise GraphCaptureError(f"the captured step runs {func} with a boolean mask, whose "
                                    "indices depend on the data (a host synchronisation): CUDA "
                                    "graph capture forbids it; use torch.where")
        if func.overloadpacket in _LIFT_OPS:
            (data,) = args
            if data.dim():
                raise GraphCaptureError(
                    f"the captured step makes a tensor of {tuple(data.shape)} from host data "
                    "(torch.tensor): on CUDA a host-to-device copy, which capture forbids")
            self._made.add(_storage(data))  # a new scalar at every run: its value is recorded
            self.ops.append((str(func), (data.dtype, data.item())))
            return func(*args, **kwargs)
        signature = []
        for value in _flatten([*args, *kwargs.values()]):
            if isinstance(value, torch.Tensor):
                ptr = _storage(value)
                outside = ptr in self._outside or (ptr not in self._made and ptr != 0)
                if outside:
                    self._outside.add(ptr)
                signature.append((tuple(value.shape), value.dtype, ptr if outside else None))
            elif isinstance(value, (int, float, bool, str, torch.dtype, torch.device,
                                    type(None))):
                signature.append(value)
            else:
                signature.append(type(value).__name__)
        out = func(*args, **kwargs)
        for value in _flatten([out]):
            if isinstance(value, torch.Tensor) and _storage(value) not in self._outside:
                self._made.add(_storage(value))
        self.ops.append((str(func), tuple(signature)))
        return out


@contextmanager
def _checked() -> Iterator[_CaptureChecks]:
    checks = _CaptureChecks()
    with _HostSyncFunctions(), checks:
        yield checks


class StandInGraph:
    """``step`` captured (checked and recorded, its writes undone) and replayed by re-running it
    under the same checks (module docstring)."""

    captures = 0
    """Captures made in this process (tests count them)."""

    def __init__(self, step: Callable[[], None],
                 watched: Callable[[], dict[str, torch.Tensor]],
                 capture_error_mode: str = "global") -> None:
        """Capture ``step``.

        Args:
            step: the captured computation, reading and writing only tensors that outlive it.
            watched: the named buffers the step reads or writes (called at capture and at each
                replay); their values are restored after the capture run, and their addresses
                compared at each replay.
            capture_error_mode: as ``torch.cuda.graph``'s (its default here too); kept as
                :attr:`capture_error_mode`.

        Raises:
            GraphCaptureError: the step synchronises with the host, or the capture mode is
                ``global`` (module docstring).
            ValueError: an unknown capture mode.
        """
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode={capture_error_mode!r} must be one of "
                             f"{CAPTURE_ERROR_MODES}")
        if capture_error_mode == "global":
            raise GraphCaptureError(
                "capture_error_mode='global' fails the capture when another thread makes a "
                "CUDA call that capture deems unsafe (NCCL allocating for the transfer "
                "thread's first send to a new peer); capture with 'thread_local'")
        self.capture_error_mode = capture_error_mode
        self.step = step
        self.watched = watched
        buffers = watched()
        saved = {name: t.clone() for name, t in buffers.items()}
        with torch.no_grad(), _checked() as checks:
            step()
        # a real capture records the kernels without running them: nothing changes
        with torch.no_grad():
            for name, tensor in buffers.items():
                tensor.copy_(saved[name])
        self.ops = checks.ops
        self.addresses = {name: _storage(t) for name, t in buffers.items()}
        self.replays = 0
        StandInGraph.captures += 1

    def replay(self) -> None:
        """Run the captured step again.

        Raises:
            GraphCaptureError: a watched buffer moved, or the step read or wrote another buffer
                or ran another op than at capture.
        """
        moved = [name for name, t in self.watched().items()
                 if self.addresses.get(name) != _storage(t)]
        if moved or self.watched().keys() != self.addresses.keys():
            raise GraphCaptureError(
                "buffers moved (or appeared) since the graph was captured; a CUDA graph would "
                f"still read and write the old memory: {sorted(moved) or 'new buffers'}")
        with torch.no_grad(), _checked() as checks:
            self.step()
        if checks.ops != self.ops:
            pairs = zip(checks.ops, self.ops, strict=False)
            at = next((i for i, (now, then) in enumerate(pairs) if now != then),
                      min(len(checks.ops), len(self.ops)))
            now = checks.ops[at] if at < len(checks.ops) else "nothing"
            then = self.ops[at] if at < len(self.ops) else "nothing"
            raise GraphCaptureError(
                f"op {at} of the replayed step differs from the captured one (a buffer at "
                "another address, another shape or another Python value: a CUDA graph replays "
                f"the captured one): captured {then}, now {now}")
        self.replays += 1
