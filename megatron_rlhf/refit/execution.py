"""Execute a refit plan with megatron-core's resharding executor and copy services.

A :class:`~megatron_rlhf.refit.transfer_plan.RefitPlan` is turned into this rank's megatron
``ReshardPlan`` (``TransferOp`` send and receive lists sharing ``task_id``s) and run by
``megatron.core.resharding.execute_reshard_plan`` through a ``CopyService``: batched
point-to-point sends and receives (``dist.batch_isend_irecv``), same-rank copies matched by task
id. Padded vocabulary rows, which no source holds, are zeroed afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.resharding import ReshardPlan, TransferOp, execute_reshard_plan
from megatron.core.resharding.copy_services.base import CopyService
from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService
from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService

from megatron_rlhf.refit.layout import box_slices
from megatron_rlhf.refit.transfer_plan import RefitPlan, ZeroFill
from megatron_rlhf.runtime.distributed import new_member_group

COPY_BACKENDS = ("pair", "nccl", "gloo")
"""Copy services by name (``nvshmem`` needs NVSHMEM on GPUs; pass an instance).

``pair`` is :class:`PairCopyService`: megatron's ``NCCLCopyService`` with the sends and receives
on a process group of the two models' ranks only, with its own timeout. ``nccl`` is megatron's
``NCCLCopyService``: ``batch_isend_irecv`` on the default process group, whatever its backend
(NCCL on GPUs, gloo on CPU). ``gloo`` is ``GlooCopyService``: a separate gloo group over the
world, with GPU tensors staged through host memory.
"""


class PairCopyService(NCCLCopyService):
    """megatron's ``NCCLCopyService`` whose remote sends and receives run on ``group`` (the
    source's and destination's ranks) instead of the default group: a shadow waiting for its
    trainer's weights then holds no world operation back, and waits under the group's timeout
    (``runtime.transfer_timeout_s``), not the world's. Same-rank copies are megatron's."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group

    def run(self) -> None:
        remote = ([op for op in self.send_ops if op.dest_rank != self.rank],
                  [op for op in self.recv_ops if op.src_rank != self.rank])
        self.send_ops = [op for op in self.send_ops if op.dest_rank == self.rank]
        self.recv_ops = [op for op in self.recv_ops if op.src_rank == self.rank]
        super().run()  # the local copies
        ops = [*(dist.P2POp(dist.isend, op.tensor, op.dest_rank, group=self.group)
                 for op in remote[0]),
               *(dist.P2POp(dist.irecv, op.tensor, op.src_rank, group=self.group)
                 for op in remote[1])]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()


def make_copy_service(backend: str | CopyService, ranks: list[int],
                      timeout_s: float) -> CopyService:
    """A copy service by name, or ``backend`` itself if it is one.

    ``"pair"`` creates a process group of ``ranks`` (the two models' ranks) with ``timeout_s``,
    ``"gloo"`` one over the world: collective, so every rank must call this at the same point.

    Raises:
        ValueError: an unknown backend name.
    """
    if isinstance(backend, CopyService):
        return backend
    if backend == "pair":
        return PairCopyService(new_member_group(ranks, timeout_s, "refit_pair"))
    if backend == "nccl":
        return NCCLCopyService()
    if backend == "gloo":
        return GlooCopyService()
    raise ValueError(f"refit copy_service={backend!r} is unknown: choose one of {COPY_BACKENDS} "
                     "or pass a megatron CopyService instance")


def rank_reshard_plan(plan: RefitPlan, rank: int) -> ReshardPlan:
    """This rank's sends and receives as megatron ``TransferOp``s (task id = transfer index)."""
    sends = [TransferOp(param_name=t.src_name, peer_rank=t.dst_rank, is_send=True,
                        my_slice=box_slices(t.src_box), peer_slice=box_slices(t.dst_box),
                        task_id=t.task_id)
             for t in plan.sends(rank)]
    receives = [TransferOp(param_name=t.dst_name, peer_rank=t.src_rank, is_send=False,
                           my_slice=box_slices(t.dst_box), peer_slice=box_slices(t.src_box),
                           task_id=t.task_id)
                for t in plan.receives(rank)]
    return ReshardPlan(send_ops=sends, recv_ops=receives)


def execute(reshard_plan: ReshardPlan, zero_fills: list[ZeroFill],
            src_module: torch.nn.Module | None, dst_module: torch.nn.Module | None,
            service: CopyService) -> None:
    """Run this rank's part of a refit: collective over the two models' ranks with the
    ``pair`` service (other ranks return at once), over the default group with the others.

    Args:
        reshard_plan: from :func:`rank_reshard_plan`.
        zero_fills: this rank's padding regions (``RefitPlan.zero_fills_on``).
        src_module: this rank's part of the source model, None if it holds none.
        dst_module: this rank's part of the destination model, None if it holds none.
        service: the copy service (the same kind on every rank).
    """
    if isinstance(service, PairCopyService) and service.group is None:
        return  # this rank holds neither model
    # megatron's executor looks parameters up by name; a rank without a side passes an empty module.
    src_module = torch.nn.Module() if src_module is None else src_module
    dst_module = torch.nn.Module() if dst_module is None else dst_module
    if torch.cuda.is_available():
        # megatron's NCCLCopyService copies same-rank tensors on a side stream that does not
        # wait for the current one, where the optimizer may still be writing the source weights.
        torch.cuda.current_stream().synchronize()
    if isinstance(service, PairCopyService):
        _execute_on_pair(reshard_plan, src_module, dst_module, service)
    else:
        execute_reshard_plan(reshard_plan, src_module, dst_module, service=service)
    if not zero_fills:
        return
    params = dict(dst_module.named_parameters())
    with torch.no_grad():
        for fill in zero_fills:
            params[fill.local_name].data[box_slices(fill.box)].zero_()


def _execute_on_pair(plan: ReshardPlan, src_module: torch.nn.Module,
                     dst_module: torch.nn.Module, service: PairCopyService) -> None:
    """megatron's ``execute_reshard_plan`` without its closing ``dist.barrier()`` on the world.

    That barrier would make every rank of the job, the shadows' included, wait for the refit
    under the world's timeout: in synchronous separation a shadow rank with nothing to receive
    would sit in it through its trainer's whole training stage. The pair service's ``run``
    completes every send and receive of this rank before returning, so nothing needs the
    barrier: the received buffers are written back here as megatron writes them back.
    """
    src_params = dict(src_module.named_parameters())
    dst_params = dict(dst_module.named_parameters())
    for op in plan.send_ops:
        if op.param_name in src_params:
            service.submit_send_with_id(op.task_id, src_params[op.param_name].data[
                op.my_slice].contiguous(), op.peer_rank)
    writebacks = []
    for op in plan.recv_ops:
        if op.param_name in dst_params:
            param = dst_params[op.param_name]
            buffer = torch.empty_like(param.data[op.my_slice].contiguous())
            service.submit_recv_with_id(op.task_id, buffer, op.peer_rank)
            writebacks.append((buffer, param, op.my_slice))
    service.run()
    with torch.no_grad():
        for buffer, param, where in writebacks:
            param.data[where].copy_(buffer)
