"""Checking a weight sync: what each shadow rank received against what its sender sent.

A refit that copies the wrong region, misses a tensor or transposes a shard leaves a shadow that
generates with other weights than the trainer's, and PPO then learns from a policy it is not
training, silently. After a checked sync every rank computes a checksum of each region it sent
and of each region it received (after the write-back), the senders' checksums are gathered on
the sync's group, and a receiver whose region differs stops the run naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.refit.layout import box_slices
from megatron_rlhf.refit.transfer_plan import RefitPlan

VERIFY_MODES = ("first", "every", "off")


@dataclass
class RefitConfig:
    """How the weight sync into the shadows is checked."""

    verify: str = "first"
    """Compare each received region's checksum with its sender's after the ``first`` sync (a
    layout bug shows at once, and later syncs move the same regions), after ``every`` sync, or
    ``off``. A mismatch stops the run naming the tensor."""

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"refit.verify={self.verify!r} must be one of {VERIFY_MODES}")


class RefitMismatch(RuntimeError):
    """A region a shadow received differs from what its sender sent."""


def region_checksum(region: torch.Tensor) -> float:
    """A float64 sum of the region's values weighted by position (1 to 251, cycling): the same
    values in another order, as a transposed or misplaced shard holds them, sum differently."""
    flat = region.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 251 + 1
    return float((flat * weights).sum())


def verify_sync(plan: RefitPlan, rank: int, src_params: Mapping[str, torch.Tensor],
                dst_params: Mapping[str, torch.Tensor],
                group: dist.ProcessGroup | None) -> None:
    """Compare this rank's received regions with their senders' (collective over ``group``,
    the sync's ranks; None: the world).

    Raises:
        RefitMismatch: naming the first region that differs.
    """
    sent = {t.task_id: region_checksum(src_params[t.src_name][box_slices(t.src_box)])
            for t in plan.sends(rank)}
    gathered: list[dict[int, float] | None] = [None] * dist.get_world_size(group)
    # The sync's group: every rank that sent or received takes part, no other.
    dist.all_gather_object(gathered, sent, group=group)
    expected = {task: value for part in gathered if part for task, value in part.items()}
    for transfer in plan.receives(rank):
        got = region_checksum(dst_params[transfer.dst_name][box_slices(transfer.dst_box)])
        want = expected[transfer.task_id]
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
            raise RefitMismatch(
                f"weight sync: {transfer.dst_name}{list(transfer.dst_box)} on rank {rank} "
                f"differs from what rank {transfer.src_rank} sent of {transfer.src_name}"
                f"{list(transfer.src_box)} (checksum {got:.9g}, sent {want:.9g}): the shadow "
                "would generate with other weights than the trainer's")
