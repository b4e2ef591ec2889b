"""Every change megatron_rlhf makes to torch, megatron-core or the process, listed in one place.

Importing megatron_rlhf changes nothing. Each entry of :data:`PATCHES` is made by an explicit
call, named in its ``applied_by``: :func:`megatron_rlhf.runtime.bootstrap.initialize_runtime`
makes the process-wide ones, and tests can undo them (:func:`undo_cpu_compat`).

    apply_cpu_compat()            # no CUDA: torch.cuda stand-ins, the CUDA-to-CPU mode, RNG tracker
    define_moe_router_gemm()      # no Transformer Engine: MoE routers multiply with torch
    add_warning_filters()         # silence megatron's notices about missing GPU extras
    with default_group_gathers_scoped_to(pg):   # while megatron builds one model's optimizer
        ...
    with megatron_fsdp_wrapping(pg_collection): # while Megatron-FSDP wraps one model
        ...
    undo_cpu_compat()             # tests: back to the unpatched torch and megatron

Each entry was checked against :data:`CHECKED_WITH`; a new megatron-core or torch means reading
every entry again (``check_megatron_core_version`` refuses another megatron-core).

megatron-core is imported by the functions that patch it, not by this module: ``runtime.faults``
imports this module for the private torch APIs, and a fault tracker must stay cheap to start.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

CHECKED_WITH = {"megatron-core": "0.16.1", "torch": "2.13.0 (CPU), 2.11 (CUDA)"}
"""0.16.0 too: its source differs from 0.16.1's in nothing these entries touch
(``cpu_compat.TESTED_MEGATRON_CORE_VERSIONS``)."""
"""The versions every entry of :data:`PATCHES` was checked against."""


@dataclass(frozen=True)
class Patch:
    """One change to a third-party library or to process-wide state, or one private API used.

    Attributes:
        target: what is replaced, entered or called (dotted names).
        reason: which code needs it, and why there is no public way.
        applied_by: the function that makes it (and the one that undoes it, if any).
    """

    target: str
    reason: str
    applied_by: str


PATCHES: tuple[Patch, ...] = (
    Patch("torch.cuda.current_device, set_device, synchronize, empty_cache",
          "megatron-core allocates on torch.cuda.current_device() (GlobalMemoryBuffer, rotary "
          "embeddings, inference contexts) and synchronises; on CPU these mean 'cpu' and no-ops",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("torch.cuda.Stream, Event, current_stream, default_stream, stream",
          "pipeline schedules, DDP's communication stream and the resharding copy services "
          "create streams and events; CPU work is already ordered, so they are no-ops (events "
          "time with the host clock)",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("torch.cuda.memory_allocated, max_memory_allocated, memory_reserved, "
          "max_memory_reserved",
          "megatron's memory reports read them; 0 on CPU",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("torch.cuda.manual_seed, manual_seed_all, get_rng_state, set_rng_state",
          "torch.manual_seed calls torch.cuda.manual_seed_all and megatron saves 'the CUDA RNG "
          "state'; on CPU that state is the CPU generator's",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("megatron.core.tensor_parallel.random._get_cuda_rng_state, _set_cuda_rng_state",
          "activation recomputation (CheckpointFunction) saves and restores the CUDA RNG state "
          "through these private helpers so that dropout replays identically",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("torch.overrides.TorchFunctionMode: cpu_compat.CudaToCpuMode on the mode stack",
          "literal device='cuda' allocations and .cuda() calls throughout megatron-core "
          "(schedules' token counters, optimizer found-inf flags, grad clipping, causal masks, "
          "checkpoint buffers) become CPU tensors; Tensor.type() names CUDA types for callers in "
          "megatron.core.optimizer, which accept only those",
          "apply_cpu_compat (no CUDA only; entered, left by undo_cpu_compat; left for the "
          "duration of generate_sequences by cuda_redirect_suspended)"),
    Patch("megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER (+ _INITIALIZED)",
          "every megatron module draws dropout streams from get_cuda_rng_tracker(), which returns "
          "this private global; cpu_compat.CpuRNGStatesTracker keeps the streams in the CPU "
          "generator",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
          "the all-to-all MoE token dispatcher passes its token counts to all_to_all_single as "
          "split sizes after this helper made them host numpy arrays; it converts only CUDA "
          "tensors, so on CPU they stay tensors, which the collective refuses "
          "(cpu_compat.moe_split_sizes_to_host)",
          "apply_cpu_compat (no CUDA only); undo_cpu_compat"),
    Patch("megatron.core.transformer.moe.moe_utils.te_general_gemm, defined as None where "
          "Transformer Engine is not installed",
          "RouterGatingLinearFunction (every MoE router's forward and backward) tests "
          "'te_general_gemm is not None', a name bound only when Transformer Engine imports: "
          "without it the router raises NameError. None is what the test means: torch's matmul",
          "define_moe_router_gemm (models.gpt.build_gpt_model, MoE models only); never undone"),
    Patch("megatron.core.parallel_state._set_global_memory_buffer",
          "megatron's attention and sequence-parallel code borrow scratch tensors from this "
          "buffer, which only its global initialize_model_parallel creates otherwise (we build "
          "groups ourselves)",
          "ensure_megatron_memory_buffer (initialize_runtime); never undone"),
    Patch("torch.distributed.all_gather_object, replaced while get_megatron_optimizer runs",
          "megatron aligns optimizer parameter groups with an all_gather_object over the default "
          "group; with models on disjoint ranks it must span one model's ranks only",
          "default_group_gathers_scoped_to (a context manager, models.trainer.ModelTrainer)"),
    Patch("megatron.core.parallel_state._TENSOR_MODEL_PARALLEL_GROUP, "
          "_EXPERT_TENSOR_PARALLEL_GROUP, set while Megatron-FSDP wraps a model",
          "mcore_fsdp_adapter.FullyShardedDataParallel._fix_tensor_parallel_attributes reads the "
          "TP and expert-TP groups from the global parallel state (asserting they exist) even "
          "when given a pg_collection; they are that model's groups while it wraps",
          "megatron_fsdp_wrapping (a context manager, models.trainer.ModelTrainer)"),
    Patch("torch.cuda.current_device, 0 while Megatron-FSDP wraps a model (no CUDA only)",
          "megatron_fsdp.MegatronFSDP.__init__ formats torch.device(f'cuda:{current_device()}') "
          "to compare with the device it is given; apply_cpu_compat's 'cpu' makes that an "
          "invalid device string. The model's own device is passed explicitly, so the name only "
          "feeds a log message",
          "megatron_fsdp_wrapping (a context manager, models.trainer.ModelTrainer)"),
    Patch("megatron.core.distributed.fsdp.mcore_fsdp_adapter.TELinear, while Megatron-FSDP "
          "wraps a model (no Transformer Engine only)",
          "_fix_tensor_parallel_attributes calls isinstance(module, (TELinear,)) when TP > 1; "
          "without Transformer Engine TELinear is a MagicMock built on megatron's stand-in for "
          "the missing module, and isinstance raises. A class no module "
          "belongs to says what is true: there are no TE layers",
          "megatron_fsdp_wrapping (a context manager, models.trainer.ModelTrainer)"),
    Patch("torch.distributed.distributed_c10d._set_pg_timeout (private API)",
          "the default group's timeout, for a group another component created with a different "
          "one; torch has no public setter",
          "set_default_group_timeout (engine.runner via faults.install_fault_tracker)"),
    Patch("torch.distributed.distributed_c10d._get_default_store (private API)",
          "the fault tracker records each rank's stage in the job's store; torch exposes the "
          "default group's store only through this",
          "default_group_store (faults.install_fault_tracker)"),
    Patch("megatron.core.dist_checkpointing.strategies.torch._replace_state_dict_keys_with_"
          "sharded_keys, _unwrap_pyt_sharded_tensor, _replace_sharded_keys_with_state_dict_keys, "
          "_restore_dict_types (private API)",
          "models.checkpoint reads and writes megatron's torch_dist format without megatron's "
          "global-state save/load entry points",
          "called directly in models/checkpoint.py"),
    Patch("megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_"
          "queue (private API), replaced while a background save prepares its buckets; "
          "torch.distributed.checkpoint.filesystem._write_item (private API) called directly",
          "megatron's asynchronous writer collects results through a spawn-context manager "
          "process (refused in daemonic ranks, re-runs a launcher without a __main__ guard); "
          "models.background_save writes from a thread of the rank with torch's item writer, "
          "as megatron's writer processes do",
          "called in models/background_save.py (ThreadedWriter)"),
    Patch("warnings.filters",
          "megatron-core announces every optional GPU extra it did not find (Transformer Engine, "
          "Apex) and uses deprecated torch APIs (torch.jit.script_method, all_gather_into_tensor "
          "and reduce_scatter_tensor aliases, ShardedTensor in its checkpoints); on CPU these say nothing about a run. Those raised while megatron-core is "
          "being imported come before any call and still show (pytest filters them itself)",
          "add_warning_filters (initialize_runtime); never undone"),
    Patch("torch.distributed.batch_isend_irecv, new_group, split_group and the collectives of "
          "nccl_semantics.TRACKED_COLLECTIVES (in torch.distributed and distributed_c10d)",
          "the tests' NCCL-semantics mode: gloo answers a batch with one work, checks a fresh "
          "group's first batch, times works from their post, compares group creation order and "
          "emulates split_group, so code that would fail under NCCL fails on CPU. Test mode only "
          "(MEGATRON_RLHF_NCCL_SEMANTICS=1 on a gloo world)",
          "called by testing/nccl_semantics.py's install (init_distributed, test mode only); "
          "undone by its uninstall (destroy_distributed)"),
    Patch("torch.distributed.distributed_c10d._get_process_group_name, ProcessGroup._get_backend"
          "(...).options._timeout (private API)",
          "the NCCL-semantics mode names a group's keys in the job's store after the group, and "
          "reads a group's timeout to time its works as NCCL's watchdog does; torch exposes "
          "neither publicly",
          "called in testing/nccl_semantics.py (test mode only)"),
)

_WARNING_FILTERS: tuple[tuple[str, type[Warning], str], ...] = (
    # (message regex, category, module regex); each a notice of third-party code about itself
    # that no setting of a run changes. Our own warnings match none of them.
    # megatron announces every optional GPU extra it did not find, once per importing module.
    (r".*(Transformer Engine|Apex|apex|transformer_engine).*", Warning, ""),
    # megatron's own deprecation notices about its APIs.
    ("", DeprecationWarning, r"megatron\.core.*"),
    # torch warns about its own deprecated torch.jit.script_method when megatron's imports
    # reach it.
    (r".*torch\.jit\.script_method.*is deprecated.*", Warning, ""),
    # megatron's TransformerConfig warns that its own default cuda_graph_scope ("full") is
    # deprecated, at every model built.
    (r".*full scope is deprecated.*", Warning, ""),
    # megatron's distributed optimizer still calls the deprecated all_gather_into_tensor and
    # reduce_scatter_tensor aliases.
    (r".*all_gather_into_tensor.*is deprecated.*", FutureWarning, ""),
    (r".*reduce_scatter_tensor.*is deprecated.*", FutureWarning, ""),
    # megatron's torch_dist checkpoints are written and read through torch's ShardedTensor.
    (r".*we are deprecating ShardedTensor.*", FutureWarning, ""),
    # megatron reads ``.grad`` of non-leaf tensors during backward; on CPU the read passes through
    # the CUDA-to-CPU torch function mode, which torch then names as the reader.
    (r".*\.grad attribute of a Tensor that is not a leaf Tensor.*", UserWarning,
     r"megatron_rlhf\.runtime\.cpu_compat"),
)

# What apply_cpu_compat replaced, for undo_cpu_compat: (owner, attribute) -> original value.
_originals: dict[tuple[Any, str], Any] = {}
_modes: list[TorchFunctionMode] = []


def apply_cpu_compat() -> bool:
    """Make megatron-core usable without CUDA (the entries of :data:`PATCHES` made by this
    function); idempotent.

    Returns:
        True when the CPU patches are active (no CUDA), False on a CUDA machine, where nothing
        is changed.

    Raises:
        RuntimeError: the installed megatron-core is not the supported version.
    """
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_rlhf.runtime.cpu_compat import (
        CpuRNGStatesTracker,
        CudaToCpuMode,
        check_megatron_core_version,
        cuda_replacements,
        megatron_rng_replacements,
        moe_split_sizes_to_host,
    )

    check_megatron_core_version()
    if torch.cuda.is_available():
        return False
    if _modes:
        return True
    for name, value in cuda_replacements().items():
        _replace(torch.cuda, name, value)
    for name, value in megatron_rng_replacements().items():
        _replace(mcore_random, name, value)
    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", moe_split_sizes_to_host)
    _replace(mcore_random, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker())
    _replace(mcore_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    mode = CudaToCpuMode()
    mode.__enter__()
    _modes.append(mode)
    logger.debug("megatron-core CPU compatibility layer active")
    return True


def _replace(owner: Any, name: str, value: Any) -> None:
    _originals.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def cpu_compat_active() -> bool:
    """Whether :func:`apply_cpu_compat` has patched this process (and it was not undone)."""
    return bool(_modes)


@contextlib.contextmanager
def cuda_redirect_suspended() -> Iterator[None]:
    """Leave the CUDA-to-CPU mode for code that never asks for a CUDA tensor (a model's forward
    with the KV cache: generation), and enter it again on exit.

    The mode sees every torch call of the process: a few microseconds of Python each, 12-18% of
    a generate call at the rollouts benchmark's shape on CPU (``cpu_compat_mode_cost`` in
    docs/results/rollouts.md); ``torch.compile`` of the decode step cannot trace it either.
    Other modes that declare ``suspended_in_generation`` (the NCCL-semantics test mode's) are
    left with it, in either order on the stack, or alone where the CPU layer is not active.
    Nothing changes where a mode without that declaration was entered after them.
    """
    stack = _get_current_function_mode_stack()
    ours = [i for i, mode in enumerate(stack) if getattr(mode, "suspended_in_generation", False)]
    if not ours or len(ours) != len(stack) - ours[0]:
        yield
        return
    suspended = stack[ours[0]:]
    for mode in reversed(suspended):
        mode.__exit__(None, None, None)
    try:
        yield
    finally:
        for mode in suspended:
            mode.__enter__()


def undo_cpu_compat() -> None:
    """Put back what :func:`apply_cpu_compat` replaced and leave the CUDA-to-CPU mode.

    Raises:
        RuntimeError: another torch function mode was entered after ours and is still active.
    """
    if _modes:
        if _get_current_function_mode_stack()[-1:] != _modes[-1:]:
            raise RuntimeError("cannot leave the CUDA-to-CPU mode: another TorchFunctionMode "
                               "entered after it is still active")
        _modes.pop().__exit__(None, None, None)
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def add_warning_filters() -> None:
    """Ignore megatron-core's notices about missing GPU extras and its deprecated torch calls
    (idempotent: ``warnings.filterwarnings`` replaces an identical filter)."""
    for message, category, module in _WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def define_moe_router_gemm() -> None:
    """Bind megatron's ``moe_utils.te_general_gemm`` to None where Transformer Engine did not
    import (the router then multiplies with torch); idempotent, nothing changes with TE."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def ensure_megatron_memory_buffer() -> None:
    """Create megatron's shared scratch buffer if it does not exist (it holds no parallel
    state)."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


@contextlib.contextmanager
def default_group_gathers_scoped_to(scope: dist.ProcessGroup) -> Iterator[None]:
    """Scope megatron's default-group ``all_gather_object`` calls to one model's ranks.

    ``get_megatron_optimizer`` aligns parameter groups with an ``all_gather_object`` over the
    default group into a world-sized list. With models on disjoint ranks (interleaving,
    separation) the other ranks are building other models at that moment, so the collective must
    only span this model's ranks; the world-sized list is padded with this rank's own entry (the
    alignment only takes the union of the gathered keys).
    """
    original = dist.all_gather_object

    def scoped(object_list: list, obj: Any, group: dist.ProcessGroup | None = None) -> None:
        if group is not None:
            original(object_list, obj, group=group)
            return
        gathered: list = [None] * scope.size()
        original(gathered, obj, group=scope)
        object_list[:] = gathered + [obj] * (len(object_list) - len(gathered))

    dist.all_gather_object = scoped
    try:
        yield
    finally:
        dist.all_gather_object = original


@contextlib.contextmanager
def megatron_fsdp_wrapping(pg_collection: Any) -> Iterator[None]:
    """Let megatron-core's Megatron-FSDP adapter wrap one model that has its own process groups.

    While the context is open, megatron's global TP and expert-TP groups are this model's (the
    adapter reads them besides ``pg_collection``); without CUDA, ``torch.cuda.current_device``
    is 0 (``MegatronFSDP`` formats it into a ``cuda:<index>`` name); without Transformer Engine,
    the adapter's ``TELinear`` (then a ``MagicMock``, megatron's stand-in for the missing module,
    which its ``isinstance`` check under TP > 1 cannot take) is a class no module belongs to. All are put back on exit.

    Args:
        pg_collection: the model's ``ProcessGroupCollection``.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    # A dense model has no expert parameters, so the expert-TP group only has to exist.
    groups = {"_TENSOR_MODEL_PARALLEL_GROUP": pg_collection.tp,
              "_EXPERT_TENSOR_PARALLEL_GROUP": getattr(pg_collection, "expt_tp", None)
              or pg_collection.tp}
    saved = {name: getattr(parallel_state, name) for name in groups}
    current_device = torch.cuda.current_device
    te_linear = mcore_fsdp_adapter.TELinear
    for name, group in groups.items():
        setattr(parallel_state, name, group)
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: 0
    if not isinstance(te_linear, type):
        mcore_fsdp_adapter.TELinear = _NoTransformerEngineLayer
    try:
        yield
    finally:
        mcore_fsdp_adapter.TELinear = te_linear
        torch.cuda.current_device = current_device
        for name, group in saved.items():
            setattr(parallel_state, name, group)


class _NoTransformerEngineLayer:
    """Stands in for Transformer Engine's linear layer where it is not installed: no module is
    one."""


def set_default_group_timeout(timeout_s: float) -> None:
    """Set the default process group's collective timeout."""
    distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), None)


def default_group_store() -> dist.Store:
    """The key-value store of the default process group (torchrun's, or the one it created)."""
    return distributed_c10d._get_default_store()
