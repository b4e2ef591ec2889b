"""One call that prepares a process for megatron_rlhf work, on CPU or GPU.

    initialize_runtime(RuntimeConfig(seed=1234))

sets up rank-aware logging, makes a rank killed by a signal print its Python stacks, joins the distributed job (torchrun or a world of one; under torchrun
a worker ends itself when its launcher is killed), makes megatron-core usable on a machine without
CUDA, creates megatron's shared scratch buffer, seeds every host RNG and spares the process's
exit a garbage-collector scan of its heap (:func:`exit_without_heap_scans`).
Models seed their own tensor-parallel RNG streams when they are built, because one
process may hold several models with different TP layouts. The changes this makes to torch,
megatron-core and the warning filters are the ones listed in ``runtime.patches``; importing the
package makes none of them.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megatron_rlhf.runtime.distributed import DistributedConfig, init_distributed
from megatron_rlhf.runtime.launcher_watch import watch_launcher
from megatron_rlhf.runtime.logging import setup_logging
from megatron_rlhf.runtime.patches import (
    add_warning_filters,
    apply_cpu_compat,
    ensure_megatron_memory_buffer,
)
from megatron_rlhf.runtime.seeding import seed_everything


@dataclass
class RuntimeConfig:
    """Process-level settings.

    Attributes:
        seed: seed of every host RNG (Python, numpy, torch); the same on every rank.
        log_level: logging level of the package logger.
        log_all_ranks: log from every rank instead of rank 0 only.
        allow_tf32: let fp32 matrix products and convolutions on NVIDIA GPUs use TF32 tensor
            cores (as megatron's training scripts do); no effect on CPU.
        transfer_timeout_s: timeout of the process groups that move rows between models: a
            receiver may wait through a whole stage of its sender (generation of long responses,
            scoring), which can outlast ``distributed.timeout_s``.
        distributed: how to join the job.
    """

    seed: int = 1234
    log_level: str = "INFO"
    log_all_ranks: bool = False
    allow_tf32: bool = True
    transfer_timeout_s: float = 1800.0
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"runtime.seed={self.seed} must be non-negative")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"runtime.transfer_timeout_s={self.transfer_timeout_s} must be "
                             "positive")


def report_fatal_signals() -> None:
    """Make a fault in native code (SIGSEGV, SIGABRT, SIGBUS...) print every thread's Python
    stack to stderr before the process dies, so the job's log says where a rank died, not only
    the launcher's exit code -11. Keeps a handler set before (a test harness's own file)."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


_exit_hook_registered = False


def _collect_then_freeze() -> None:
    gc.collect()  # the garbage there is now: its finalizers run, as at any exit
    gc.freeze()


def exit_without_heap_scans() -> None:
    """At exit, collect the garbage once and then move every live object out of the garbage
    collector's reach (``gc.freeze``): the interpreter's teardown otherwise scans the whole
    heap of torch and megatron-core objects in several collections, about 1 s of CPU per
    process (measured: 4.7 -> 3.9 CPU-s for a process that imports the engine and exits).
    Objects are still freed by reference counting as the modules are cleared; what is left in
    reference cycles is released with the process. Registered once per process."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_collect_then_freeze)
        _exit_hook_registered = True


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects alive on entry out of the collector's generations for the block
    (``gc.freeze``). Megatron's distributed optimizer runs a full collection in every
    ``sharded_state_dict`` call, once per trained model on each checkpoint save and load (and
    a move's teardown runs one more); each traverses every tracked object, and the modules a
    run imports are most of them (about 430,000 objects against the few thousand a tiny run's
    models add; 0.2 s a collection on one free core, 0.5 s with 4 ranks on 2 cores). Frozen
    before the run builds, those are left out, and what the run builds, an old placement's
    models among it, is still collected."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def initialize_runtime(config: RuntimeConfig | None = None) -> None:
    """Prepare this process (idempotent apart from reseeding)."""
    # Imported here: cpu_compat imports megatron-core, which a configuration holding a
    # RuntimeConfig must not pay for before it is checked.
    from megatron_rlhf.runtime.cpu_compat import check_megatron_core_version

    config = config or RuntimeConfig()
    report_fatal_signals()
    check_megatron_core_version()
    add_warning_filters()
    setup_logging(config.log_level, config.log_all_ranks)
    apply_cpu_compat()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = config.allow_tf32
        torch.backends.cudnn.allow_tf32 = config.allow_tf32
    init_distributed(config.distributed)
    watch_launcher()
    ensure_megatron_memory_buffer()
    seed_everything(config.seed)
    exit_without_heap_scans()
