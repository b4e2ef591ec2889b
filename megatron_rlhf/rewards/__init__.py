"""Rewards that users bring: reward functions over decoded text and the prompt's record, run in a
pool of worker processes, and built-in verifiers (pure Python, no torch).

Map of the files:

- ``functions.py``: ``RewardFunctionSpec``: one ``reward.functions`` entry, imported and checked
  when the config is built (``parse_reward_functions``); the ``REWARD_FUNCTIONS`` registry of the
  functions an entry names without their module.
- ``pool.py``: ``RewardFunctions``: calls every function on every row in worker processes, with
  a per-call timeout and the ``reward.on_error`` policy; ``UserCodeError``, the error of a
  user's function, tool or environment that stops the run (an entry point prints it as one line).
- ``verifiers.py``: math final-answer equivalence, exact and regex match, a format check (the
  registered ``math_reward``, ``exact_reward``, ``regex_reward``, ``format_reward``), and DAPO's
  overlong penalty.
- ``tools.py``: ``Tools``: the tools multi-turn rollouts call (``rollout.tools``), in the same
  worker pool, with a per-call timeout and ``rollout.tool_on_error``.
- ``environments.py``: ``rollout.environment``, one instance per episode.
- ``overlong.py``: ``OverlongPenalty``: that penalty on a batch's generated token counts
  (``reward.overlong_buffer``); the one module here that imports torch, so import it directly.

See ``docs/rewards.md``.
"""

from __future__ import annotations

from megatron_rlhf.rewards.functions import (
    ON_ERROR_POLICIES,
    REWARD_FUNCTIONS,
    RewardFunctionSpec,
    parse_reward_functions,
    register_reward_function,
)
from megatron_rlhf.rewards.pool import (
    RewardFunctionError,
    RewardFunctions,
    RewardScores,
    UserCodeError,
)
from megatron_rlhf.rewards.verifiers import exact_reward, format_reward, math_reward, regex_reward

__all__ = ["ON_ERROR_POLICIES", "REWARD_FUNCTIONS", "RewardFunctionError", "RewardFunctionSpec",
           "RewardFunctions", "RewardScores", "UserCodeError", "exact_reward", "format_reward",
           "math_reward", "parse_reward_functions", "regex_reward", "register_reward_function"]
