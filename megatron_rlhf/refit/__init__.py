"""Weight synchronisation (refit) from a trained model into its inference copy.

    from megatron_rlhf.refit import build_weight_sync
    sync = build_weight_sync(actor, actor_pgc, plan["actor"], shadow, shadow_pgc,
                             plan["shadow_actor"])     # every rank
    sync.sync()                                        # every rank, after each training round

| file | what |
|---|---|
| `interfaces.py` | `WeightSync`: the engine's view, one method `sync()` |
| `layout.py` | `ModelLayout`, `RankShards`, `ParamShard`: what the planner is told (pure) |
| `transfer_plan.py` | `plan_refit`: transfers and zero fills, one source copy per destination shard (pure) |
| `execution.py` | the plan as megatron `ReshardPlan`s, run by `execute_reshard_plan` + a `CopyService` |
| `sync.py` | `build_weight_sync`: gather shard descriptions, plan, execute |

See ``docs/refit.md`` for why megatron's own planner is not used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_rlhf.refit.interfaces import WeightSync
from megatron_rlhf.refit.layout import Box, ModelLayout, ParamShard, RankShards
from megatron_rlhf.refit.transfer_plan import RefitPlan, Transfer, ZeroFill, plan_refit

if TYPE_CHECKING:
    from megatron_rlhf.refit.sync import ReshardWeightSync, build_weight_sync

_FROM_SYNC = ("ReshardWeightSync", "build_weight_sync")
"""Imported on first use: ``sync`` imports megatron-core, and every module of the package (a
configuration's ``refit.verify.RefitConfig`` among them) runs this file first."""


def __getattr__(name: str) -> Any:
    if name in _FROM_SYNC:
        from megatron_rlhf.refit import sync

        return getattr(sync, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Box",
    "ModelLayout",
    "ParamShard",
    "RankShards",
    "RefitPlan",
    "ReshardWeightSync",
    "Transfer",
    "WeightSync",
    "ZeroFill",
    "build_weight_sync",
    "plan_refit",
]
