"""Build the weight synchronisation from a trained model into its shadow, on every rank.

    sync = build_weight_sync(actor, actor_pgc, plan["actor"],
                             shadow, shadow_pgc, plan["shadow_actor"])
    ...                       # a training round
    sync.sync()               # every rank, including ranks that hold neither model

Building is collective over the default process group: each rank describes the parameter shards
it holds of either model (``shard_rules``), the descriptions are all-gathered, and every rank runs
the same pure planner and keeps its own sends and receives. ``sync`` then executes them with
megatron's ``execute_reshard_plan`` and a megatron copy service (see ``docs/refit.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.resharding import ReshardPlan
from megatron.core.resharding.copy_services.base import CopyService
from megatron.core.utils import unwrap_model

from megatron_rlhf.models.weights import shard_rules
from megatron_rlhf.refit.execution import (
    PairCopyService,
    execute,
    make_copy_service,
    rank_reshard_plan,
)
from megatron_rlhf.refit.interfaces import WeightSync
from megatron_rlhf.refit.layout import LayoutLike, ModelLayout, ParamShard, RankShards
from megatron_rlhf.refit.transfer_plan import RefitPlan, ZeroFill, plan_refit
from megatron_rlhf.refit.verify import RefitConfig, verify_sync
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)


class ReshardWeightSync(WeightSync):
    """This rank's part of a planned source -> destination copy.

    Attributes:
        plan: the whole plan (identical on every rank), for inspection and logging.
        rank: this process's global rank.
    """

    def __init__(self, plan: RefitPlan, rank: int, src_model: torch.nn.Module | None,
                 dst_model: torch.nn.Module | None, service: CopyService,
                 verify: str = "first") -> None:
        self.plan = plan
        self.rank = rank
        self.verify = RefitConfig(verify).verify
        self.syncs = 0
        self._src_model = src_model
        self._dst_model = dst_model
        self._service = service
        self._reshard_plan: ReshardPlan = rank_reshard_plan(plan, rank)
        self._zero_fills: list[ZeroFill] = plan.zero_fills_on(rank)
        _check_names(self._reshard_plan, self._zero_fills, src_model, dst_model, rank)

    def sync(self) -> None:
        """Copy the source's current weights into the destination (collective, every rank),
        then check the copy when ``verify`` says so (:mod:`megatron_rlhf.refit.verify`)."""
        execute(self._reshard_plan, self._zero_fills, self._src_model, self._dst_model,
                self._service)
        self.syncs += 1
        if self.verify == "every" or (self.verify == "first" and self.syncs == 1):
            self.check()

    def check(self) -> None:
        """Compare every region this rank received with its sender's checksum; collective over
        the sync's ranks (ranks outside a pair service's group return at once).

        Raises:
            RefitMismatch: a received region differs from what was sent.
        """
        group = None
        if isinstance(self._service, PairCopyService):
            if self._service.group is None:
                return
            group = self._service.group
        params = [{} if model is None else {name: p.data for name, p in model.named_parameters()}
                  for model in (self._src_model, self._dst_model)]
        verify_sync(self.plan, self.rank, *params, group)
        logger.info("refit verified: each of the %d regions was received as it was sent",
                    len(self.plan.transfers))


class FirstFullSync(WeightSync):
    """A sync whose first call copies every weight and whose later calls copy only what
    changes: a model trained through LoRA adapters moves its frozen base once.

    Attributes:
        full: the copy of every parameter (the first sync).
        then: the copy of the trained ones (every later sync).
    """

    def __init__(self, full: WeightSync, then: WeightSync) -> None:
        self.full = full
        self.then = then
        self.syncs = 0

    def sync(self) -> None:
        """The full copy the first time, the trained parameters' after (collective)."""
        (self.full if self.syncs == 0 else self.then).sync()
        self.syncs += 1


def build_weight_sync(
    src_model: torch.nn.Module | None,
    src_pg_collection: ProcessGroupCollection | None,
    src_layout: LayoutLike,
    dst_model: torch.nn.Module | None,
    dst_pg_collection: ProcessGroupCollection | None,
    dst_layout: LayoutLike,
    copy_service: str | CopyService = "pair",
    timeout_s: float = 1800.0,
    verify: str = "first",
    only: Callable[[str], bool] | None = None,
) -> ReshardWeightSync:
    """Plan the copy of ``src_model``'s weights into ``dst_model``; call on every rank.

    Args:
        src_model: this rank's part of the source (a GPTModel, or a DDP/Float16 wrapper of one),
            None where the rank holds none of it.
        src_pg_collection: the source's process groups on this rank, None where it holds none.
        src_layout: the source's rank block and grid (a ``topology.ModelPlacement`` or
            :class:`~megatron_rlhf.refit.layout.ModelLayout`), the same on every rank.
        dst_model: this rank's part of the destination, None where it holds none.
        dst_pg_collection: the destination's process groups on this rank, or None.
        dst_layout: the destination's rank block and grid.
        copy_service: ``"pair"`` (``batch_isend_irecv`` on a group of the two models' ranks,
            created here), ``"nccl"`` (on the default group: NCCL on GPUs, gloo on CPU),
            ``"gloo"`` (a separate gloo group), or a megatron ``CopyService``.
        timeout_s: the ``pair`` group's timeout (``runtime.transfer_timeout_s``): a shadow may
            wait through its trainer's whole training stage.
        verify: check the copy after the ``first`` sync, after ``every`` one, or ``off``
            (``refit.verify``).
        only: copy only the parameters whose (local) names it accepts, e.g. LoRA adapters
            (``models.lora.is_adapter_param``); None: every parameter.

    Returns:
        The synchronisation; its ``sync()`` is collective over the default group.

    Raises:
        ValueError: a model or group does not match its layout on this rank, or the two models
            do not describe the same parameters (see :func:`plan_refit`).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_weight_sync needs torch.distributed initialised first")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    src_layout, dst_layout = ModelLayout.of(src_layout), ModelLayout.of(dst_layout)
    src_model = unwrap_model(src_model) if src_model is not None else None
    dst_model = unwrap_model(dst_model) if dst_model is not None else None
    local = (_local_shards("src", src_model, src_pg_collection, src_layout, rank, world_size,
                           only),
             _local_shards("dst", dst_model, dst_pg_collection, dst_layout, rank, world_size,
                           only))
    gathered: list[tuple[RankShards | None, RankShards | None] | None] = [None] * world_size
    # World: every rank builds the same plan from both models' shards, wherever they are.
    dist.all_gather_object(gathered, local, group=dist.group.WORLD)
    src_shards = [entry[0] for entry in gathered if entry and entry[0] is not None]
    dst_shards = [entry[1] for entry in gathered if entry and entry[1] is not None]
    plan = plan_refit(src_shards, dst_shards)
    service = make_copy_service(copy_service, sorted({*src_layout.ranks, *dst_layout.ranks}),
                                timeout_s)
    sync = ReshardWeightSync(plan, rank, src_model, dst_model, service, verify)
    logger.info("refit plan: %d transfers (%d local), %d elements over the network",
                len(plan.transfers), sum(t.is_local for t in plan.transfers),
                sum(plan.remote_elements_sent().values()))
    return sync


def local_shards(model: torch.nn.Module, layout: ModelLayout, rank: int,
                 only: Callable[[str], bool] | None = None) -> RankShards:
    """Describe this rank's part of ``model`` (the parameters ``only`` accepts) for the
    planner (no communication)."""
    coords = layout.coords(rank)
    params = tuple(ParamShard(name, rule, tuple(param.shape), param.dtype)
                   for name, param, rule in shard_rules(model) if only is None or only(name))
    return RankShards(rank, coords.tp, layout.tp, coords.pp, coords.dp, params)


def _local_shards(side: str, model: torch.nn.Module | None,
                  pg_collection: ProcessGroupCollection | None, layout: ModelLayout, rank: int,
                  world_size: int, only: Callable[[str], bool] | None = None
                  ) -> RankShards | None:
    """Check a side's arguments against its layout; describe the shards if the rank holds any."""
    if layout.ranks.stop > world_size:
        raise ValueError(f"{side}_layout covers ranks {layout.ranks.start}.."
                         f"{layout.ranks.stop - 1} but the world has {world_size} ranks")
    if (model is None) != (pg_collection is None):
        raise ValueError(f"{side}_model and {side}_pg_collection must both be given or both be "
                         f"None on rank {rank}")
    if layout.holds(rank) != (model is not None):
        holds = "holds" if layout.holds(rank) else "does not hold"
        raise ValueError(
            f"rank {rank} {holds} a part of the {side} model according to {side}_layout "
            f"(ranks {layout.ranks.start}..{layout.ranks.stop - 1}) but {side}_model is "
            f"{'None' if model is None else 'given'}: pass the model exactly on its ranks")
    if model is None or pg_collection is None:
        return None
    coords = layout.coords(rank)
    for axis, expected in (("tp", (coords.tp, layout.tp)), ("pp", (coords.pp, layout.pp)),
                           ("dp", (coords.dp, layout.dp))):
        group = getattr(pg_collection, axis)
        if (group.rank(), group.size()) != expected:
            raise ValueError(
                f"{side}_pg_collection.{axis} has rank {group.rank()} of {group.size()} on rank "
                f"{rank}, {side}_layout says {expected[0]} of {expected[1]}: build the groups "
                "from the same layout")
    return local_shards(model, layout, rank, only)


def _check_names(reshard_plan: ReshardPlan, zero_fills: list[ZeroFill],
                 src_model: torch.nn.Module | None, dst_model: torch.nn.Module | None,
                 rank: int) -> None:
    """megatron's executor silently skips unknown names; fail here instead."""
    src_names = set() if src_model is None else {n for n, _ in src_model.named_parameters()}
    dst_names = set() if dst_model is None else {n for n, _ in dst_model.named_parameters()}
    missing = sorted({op.param_name for op in reshard_plan.send_ops} - src_names)
    missing += sorted(({op.param_name for op in reshard_plan.recv_ops}
                       | {fill.local_name for fill in zero_fills}) - dst_names)
    if missing:
        raise ValueError(f"rank {rank}: the refit plan names parameters this rank's models lack: "
                         f"{missing[:5]}; pass the same model objects that were described")
