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

from megatron_rlhf.refit.interfaces import WeightSync
from megatron_rlhf.refit.layout import Box, ModelLayout, ParamShard, RankShards
from megatron_rlhf.refit.sync import ReshardWeightSync, build_weight_sync
from megatron_rlhf.refit.transfer_plan import RefitPlan, Transfer, ZeroFill, plan_refit

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
