"""Checkpoint saves whose file writing runs in a background thread, through megatron-core's
asynchronous save (``dist_checkpointing.save(..., async_sharded_save=True)``, ``AsyncRequest``,
``AsyncCallsQueue``).

    queue = BackgroundSaveQueue()
    request = dist_checkpointing.save(state, directory, sharded_strategy=ThreadedSaveStrategy(),
                                      async_sharded_save=True)   # collective: plan, stage copies
    request.add_finalize_fn(commit)                              # e.g. the manifest and rename
    queue.schedule_async_request(request)                        # the thread writes the shards
    ... train ...
    queue.maybe_finalize_async_calls(blocking=True)              # collective: metadata, commit

What megatron does and what is changed here:

* Planning (collectives), the common state and the finalisation (gathering the write results,
  ``.metadata``, ``metadata.json``) are megatron's, run by the calling thread; the background part
  only writes this rank's files, so no collective ever runs outside the main thread.
* megatron writes with processes forked from the trainer (``TemporalAsyncCaller``,
  ``write_preloaded_data_multiproc``) and collects results through a spawn-context manager
  process; both hang or are refused on CPU ranks (see ``models.checkpoint.InProcessSaveStrategy``).
  Here one thread per save writes the buckets megatron prepared, as its
  ``write_preloaded_data`` does (torch's ``_write_item``, private API, then fsync).
* megatron's preload moves GPU tensors to the host; a CPU tensor would be written in place while
  the next optimizer step changes it. The staging here copies every tensor (a device-to-host copy
  on GPU, a clone on CPU), so the files hold the state of the step that was saved.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
)
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

WriteBucket = tuple[str, str, tuple[list, list]]


class ThreadedWriter(FileSystemWriterAsync):
    """megatron's asynchronous file-system writer, writing from a thread of this process.

    ``write_seconds`` is the background write's duration once it has run; ``error`` its
    failure (None: none), raised from the original error (a full disk's ``OSError`` included).
    megatron's finalisation gives the failure's text to its coordinator rank only; the committing
    code reads every rank's own here.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, thread_count=1)
        self.write_seconds = 0.0
        self.error: Exception | None = None

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        with _no_manager_queue():
            super().prepare_write_data(plan, planner)
        self.results_queue = queue.Queue() if self.write_buckets else None

    def get_save_function_and_args(self) -> tuple[Any, Any, list]:
        if not self.write_buckets:
            return None, None, []
        # megatron's convention: the preload function's result replaces argument 1.
        return self.write_buckets_now, partial(stage_copies, self.write_buckets), [
            torch.distributed.get_rank(), self.write_buckets, None]

    def write_buckets_now(self, rank: int, buckets: list[WriteBucket], _: None) -> None:
        """Write every bucket as megatron's ``write_preloaded_data`` does (torch's item writer,
        fsync; megatron's own needs psutil for a debug log); the outcome (results by bucket, or
        the error) goes where megatron's finalisation reads it and raises it on every rank."""
        begin = time.perf_counter()
        outcome: dict[int, list] | Exception = {}
        try:
            for index, (file_name, storage_key, (bytes_data, tensor_data)) in enumerate(buckets):
                with open(file_name, "wb") as stream:
                    outcome[index] = [
                        _write_item(self.transforms, stream, data, item, storage_key,
                                    serialization_format=SerializationFormat.TORCH_SAVE)
                        for item, data in [*bytes_data, *tensor_data]]
                    stream.flush()
                    os.fsync(stream.fileno())
        except Exception as error:  # noqa: BLE001 - reported on every rank at the commit
            outcome = RuntimeError(f"rank {rank} could not write its checkpoint shards: {error}")
            outcome.__cause__ = error
            self.error = outcome
        self.write_seconds = time.perf_counter() - begin
        self.results_queue.put(outcome)


@contextmanager
def _no_manager_queue() -> Iterator[None]:
    """megatron's writer creates its results queue in a spawn-context manager process; the
    thread's results need none (``ThreadedWriter`` sets a plain queue afterwards)."""
    original = filesystem_async._get_write_results_queue
    filesystem_async._get_write_results_queue = lambda: None
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = original


def stage_copies(buckets: list[WriteBucket]) -> list[WriteBucket]:
    """The buckets with a host copy of every tensor: what the background thread writes."""
    staged = []
    for file_name, storage_key, (bytes_data, tensor_data) in buckets:
        copies = [(item, tensor.detach().to("cpu", copy=True)) for item, tensor in tensor_data]
        staged.append((file_name, storage_key, (bytes_data, copies)))
    return staged


class ThreadedSaveStrategy(AsyncSaveShardedStrategy):
    """megatron's ``torch_dist`` format (same key mapping, main replicas only, same planner as
    ``models.checkpoint.InProcessSaveStrategy``), saved asynchronously by :class:`ThreadedWriter`.

    ``writers`` keeps each save's writer, for its ``write_seconds``.
    """

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)
        self.writers: list[ThreadedWriter] = []

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: str | Path) -> AsyncRequest:
        """Plan (collective over the default group) and stage this rank's shards; the returned
        request writes them and its finalisation (collective) writes ``.metadata``."""
        flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True)
        writer = ThreadedWriter(checkpoint_dir)
        self.writers.append(writer)
        planned, *_ = save_state_dict_async_plan(
            mcore_torch.mcore_to_pyt_state_dict(flat, is_loading=False), writer, None, 0,
            planner=mcore_torch.MCoreSavePlanner(flatten_state_dict=False,
                                                 can_run_decentralized_global_plan=False))
        write, preload, args = writer.get_save_function_and_args()
        return AsyncRequest(write, args, [partial(save_state_dict_async_finalize, *planned)],
                            preload_fn=preload)


class ThreadCaller(AsyncCaller):
    """Runs one request's write in a daemon thread (megatron's callers fork or spawn
    processes). The staging copy runs in the caller, before the thread starts."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        args = list(async_req.async_fn_args)
        if async_req.preload_fn:
            args[1] = async_req.preload_fn()
        self.thread = threading.Thread(target=async_req.async_fn, args=args,
                                       kwargs=async_req.async_fn_kwargs, daemon=True,
                                       name="checkpoint-writer")
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if blocking and self.thread is not None:
            self.thread.join()
        alive = int(self.thread is not None and self.thread.is_alive())
        done = not alive if no_dist else bool(self.sync_all_async_calls(alive))
        if done:
            self.close()
        return done

    def close(self, abort: bool = False) -> None:
        """Join the thread (a thread cannot be killed: on ``abort`` it is left to finish or to
        end with the process; its directory is never published)."""
        if self.thread is not None and not abort:
            self.thread.join()
        self.thread = None

    def __del__(self) -> None:
        pass


class BackgroundSaveQueue(AsyncCallsQueue):
    """megatron's queue of asynchronous saves, each written by a :class:`ThreadCaller`."""

    def _get_async_caller(self) -> AsyncCaller:
        return ThreadCaller()
