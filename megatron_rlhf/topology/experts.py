"""Expert-parallel groups of one model: its experts split over ``ep`` of its data-parallel ranks.

    pg_collection = with_expert_parallel(pg_collection, offset=0, tp=1, dp=2, pp=1, ep=2)
    model = build_gpt_model(arch, ModelBuildOptions(moe=MoEConfig(num_experts=4)), pg_collection)

A mixture-of-experts model runs attention on megatron's dense grid (tp, cp, dp, pp) and its
experts on a second decomposition of the same ranks, megatron's expert grid
``(expert tp, ep, expert dp, pp)``: with the expert TP equal to the model's TP (megatron's
default) and cp = 1, ``dp = ep * expert_dp`` and ``ep`` varies faster than expert DP. Each EP
group is therefore ``ep`` consecutive DP ranks, holding ``num_experts / ep`` experts each; the
tokens of its ranks are exchanged by the token dispatcher; the expert-DP group of a rank is the
ranks holding the same experts, over which expert gradients are reduced.
"""

from __future__ import annotations

import datetime
from dataclasses import fields

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection


def expert_rank_enums(offset: int, tp: int, dp: int, pp: int, ep: int
                      ) -> dict[str, list[list[int]]]:
    """Members of every expert group of a model on ranks ``[offset, offset + tp * dp * pp)``.

    Ranks follow the dense grid (``rank = offset + tp_rank + tp * (dp_rank + dp * pp_rank)``,
    ``topology.grid``) with ``dp_rank = ep_rank + ep * expert_dp_rank``.

    Returns:
        ``ep`` (ranks exchanging tokens), ``expt_dp`` (ranks holding the same experts), ``tp_ep``
        (an EP group with its TP ranks) and ``tp_ep_pp`` (that across pipeline stages), each a
        list of increasing rank lists.

    Raises:
        ValueError: ``ep`` does not divide ``dp``.
    """
    if ep < 1 or dp % ep:
        raise ValueError(f"ep({ep}) must divide the model's data-parallel size dp({dp}): choose "
                         f"ep in {[d for d in range(1, dp + 1) if dp % d == 0]}")
    expert_dp = dp // ep

    def rank(t: int, e: int, k: int, p: int) -> int:
        return offset + t + tp * (e + ep * k + dp * p)

    tps, eps, edps, pps = range(tp), range(ep), range(expert_dp), range(pp)
    return {
        "ep": [[rank(t, e, k, p) for e in eps] for p in pps for k in edps for t in tps],
        "expt_dp": [[rank(t, e, k, p) for k in edps] for p in pps for e in eps for t in tps],
        "tp_ep": [sorted(rank(t, e, k, p) for e in eps for t in tps) for p in pps for k in edps],
        "tp_ep_pp": [sorted(rank(t, e, k, p) for e in eps for t in tps for p in pps)
                     for k in edps],
    }


def with_expert_parallel(pg_collection: ProcessGroupCollection | None, offset: int, tp: int,
                         dp: int, pp: int, ep: int,
                         timeout: datetime.timedelta | None = None
                         ) -> ProcessGroupCollection | None:
    """A model's collection with its expert groups for expert parallelism ``ep``.

    Collective over the default group: every rank calls it with the same numbers, also ranks that
    hold no part of the model (``pg_collection`` None; they get None back). With ``ep == 1`` the
    collection is returned unchanged (megatron's dense defaults: EP of one rank, expert DP = DP).

    Args:
        pg_collection: this rank's dense groups of the model, or None.
        offset: the model's first global rank.
        tp, dp, pp: the model's dense layout (cp = 1).
        ep: expert-parallel size; must divide ``dp``.
        timeout: timeout of collectives on the new groups; None keeps the default group's.

    Raises:
        ValueError: ``ep`` does not divide ``dp``.
    """
    enums = expert_rank_enums(offset, tp, dp, pp, ep)
    if ep == 1:
        return pg_collection
    me = dist.get_rank()
    created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    mine: dict[str, dist.ProcessGroup | None] = {}
    for name, enumeration in enums.items():
        for ranks in enumeration:
            key = tuple(ranks)
            if key not in created:
                group = dist.new_group(list(key), timeout=timeout, group_desc=f"expert_{name}")
                created[key] = group if me in key else None
            if me in key:
                mine[name] = created[key]
    if pg_collection is None:
        return None
    groups = {f.name: getattr(pg_collection, f.name) for f in fields(pg_collection)
              if hasattr(pg_collection, f.name)}
    groups.update(ep=mine["ep"], tp_ep=mine["tp_ep"], tp_ep_pp=mine["tp_ep_pp"],
                  expt_dp=mine["expt_dp"], intra_expt_dp=mine["expt_dp"])
    return ProcessGroupCollection(**groups)
