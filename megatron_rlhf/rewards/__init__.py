"""Rewards that users bring: reward functions over decoded text and the prompt's record, run in a
pool of worker processes, and built-in verifiers (pure Python, no torch).

Map of the files:

- ``functions.py``: ``RewardFunctionSpec``: one ``reward.functions`` entry, imported and checked
  when the config is built (``parse_reward_functions``).
- ``pool.py``: ``RewardFunctions``: calls every function on every row in worker processes, with
  a per-call timeout and the ``reward.on_error`` policy.
- ``verifiers.py``: math final-answer equivalence, exact and regex match, a format check, and
  DAPO's overlong penalty.
- ``overlong.py``: ``OverlongPenalty``: that penalty on a batch's generated token counts
  (``reward.overlong_buffer``); the one module here that imports torch, so import it directly.

See ``docs/rewards.md``.
"""

from __future__ import annotations

from megatron_rlhf.rewards.functions import (
    ON_ERROR_POLICIES,
    RewardFunctionSpec,
    parse_reward_functions,
)
from megatron_rlhf.rewards.pool import RewardFunctionError, RewardFunctions, RewardScores

__all__ = ["ON_ERROR_POLICIES", "RewardFunctionError", "RewardFunctionSpec", "RewardFunctions",
           "RewardScores", "parse_reward_functions"]
