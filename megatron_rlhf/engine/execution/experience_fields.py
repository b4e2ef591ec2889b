"""The experience record: every field of a PPO step's batch, declared once.

    features = engine.experience_features(functions=True)   # what this run's batches hold
    check_experience(batch.fields, expected_fields(features, EXPERIENCE), "step 3's experience")

Batches move between models as name-keyed tensors (``DistBatch``, generic); this module says which
names the experience holds and when. :data:`FIELDS` gives each its dtype, per-row shape, producer
and the run setting it depends on, an :class:`ExperienceFeatures` flag derived from the run (never
read off a batch). Code that reads an optional field asks that flag, and the step checks a batch
at its seams (scored, advantages added, before training), so a field that should be there and is
not, or one nobody declared, is refused by name instead of silently switching a branch.

Stages, in order: :data:`SCORED` (``PPOEngine.make_experience``: the rollout and the experience
passes; what held-out evaluation reads), :data:`EXPERIENCE` (``PPOAlgorithm.produce``: weight
versions, advantages, returns and KL added; what is trained on and checkpointed) and
:data:`TRAINING` (the proximal log-probs added, on the actor's last pipeline stage).

Shapes: ``B`` rows, ``P`` prompt width, ``R`` response width, ``k`` reward functions, ``L`` MoE
layers, ``K`` experts per token.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from megatron_rlhf.engine.execution.episodes import STAT_FIELDS
from megatron_rlhf.models.moe import ROUTES

SCORED, EXPERIENCE, TRAINING = "scored", "experience", "training"
"""The seams where a batch is checked (see the module docstring)."""

VERSION_FIELD = "weight_version"
"""The experience field of the token versions (``engine/step/staleness.py``)."""

VERSION_OFFSETS = "version_offsets"
"""The rollout field of the weight updates before each token (partial rollouts)."""


@dataclass(frozen=True)
class ExperienceFeatures:
    """Which optional fields a run's experience holds: each flag comes from the run's settings
    (``PPOEngine.experience_features``), and each optional field of :data:`FIELDS` names one."""

    critic: bool = False
    """A value model (``placement.critic``; estimator gae): ``values``."""
    reward_model: bool = False
    """A reward model (``placement.reward``): ``rm_scores``."""
    functions: bool = False
    """Reward functions (``reward.functions``): ``function_scores``, ``reward_errors``."""
    episodes: bool = False
    """Tools or an environment (multi-turn rollouts): the ``episode_*`` counts."""
    replayed_routes: bool = False
    """MoE routing replay (``models.moe.router_replay``): the policy's routes."""
    partial_rollouts: bool = False
    """``rollout.partial_rollouts``: the weight updates during generation, per token."""
    proximal: bool = False
    """An off-policy correction with a proximal policy (``algorithm.off_policy``)."""


@dataclass(frozen=True)
class FieldSpec:
    """One experience field.

    Attributes:
        name: its key in the batch.
        dtype: its dtype in the batch (and on the wire).
        shape: its shape, for the reader.
        producer: who writes it.
        when: the :class:`ExperienceFeatures` flag it depends on; None: always there.
        stages: the stages whose batches hold it.
    """

    name: str
    dtype: torch.dtype
    shape: str
    producer: str
    when: str | None = None
    stages: tuple[str, ...] = (SCORED, EXPERIENCE, TRAINING)


_AFTER = (EXPERIENCE, TRAINING)
_F32, _I64 = torch.float32, torch.int64

FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("input_ids", _I64, "[B, P + R]", "generation: prompt (left-padded) and response"),
    FieldSpec("attention_mask", _I64, "[B, P + R]", "generation: 1 at real tokens"),
    FieldSpec("response_mask", _I64, "[B, R]", "generation: 1 at trained response tokens "
              "(0 at observations); stale answers zeroed before training"),
    FieldSpec("gen_logprobs", _F32, "[B, R]", "generation: the sampler's log-probs (behaviour)"),
    FieldSpec(VERSION_OFFSETS, _I64, "[B, R]", "generation: weight updates before each token",
              "partial_rollouts", (SCORED,)),
    *(FieldSpec(name, _F32, "[B]", f"an episode's {stat.replace('_', ' ')}", "episodes")
      for stat, name in STAT_FIELDS.items()),
    FieldSpec("old_logprobs", _F32, "[B, R]",
              "the policy's forward (generation's with rollout.reuse_generation_logprobs)"),
    FieldSpec(ROUTES, _F32, "[B, P + R, L, K]", "the policy's forward: experts of each token",
              "replayed_routes"),
    FieldSpec("ref_logprobs", _F32, "[B, R]", "the reference (or the actor's base, adapters off)"),
    FieldSpec("values", _F32, "[B, R]", "the critic (the actor's value head under AC-Share)",
              "critic"),
    FieldSpec("rm_scores", _F32, "[B]", "the reward model", "reward_model"),
    FieldSpec("rule_scores", _F32, "[B]", "the scorer: the rule reward (0 without a rule)"),
    FieldSpec("function_scores", _F32, "[B, k]", "the scorer: each reward function",
              "functions"),
    FieldSpec("reward_errors", _F32, "[B]", "the scorer: failed reward-function calls",
              "functions"),
    FieldSpec(VERSION_FIELD, _I64, "[B, R]", "the step: each token's weight version (-1 at "
              "padding)", stages=_AFTER),
    FieldSpec("advantages", _F32, "[B, R]", "the step: the advantage estimator", stages=_AFTER),
    FieldSpec("returns", _F32, "[B, R]", "the step: the estimator's value targets",
              stages=_AFTER),
    FieldSpec("kl", _F32, "[B, R]", "the step: per-token KL penalty to the reference",
              stages=_AFTER),
    FieldSpec("proximal_logprobs", _F32, "[B, R]", "the actor before the step's first update",
              "proximal", (TRAINING,)),
)
"""Every experience field, in the order the engine adds them."""

SPECS: dict[str, FieldSpec] = {spec.name: spec for spec in FIELDS}


class ExperienceFields(TypedDict, total=False):
    """The experience batch's fields (``FIELDS`` gives shapes and conditions), for type
    checkers; at run time it is a plain ``dict[str, Tensor]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    gen_logprobs: torch.Tensor
    version_offsets: torch.Tensor
    episode_turns: torch.Tensor
    episode_tool_calls: torch.Tensor
    episode_tool_errors: torch.Tensor
    episode_observation_tokens: torch.Tensor
    episode_truncated: torch.Tensor
    episode_tool_seconds: torch.Tensor
    episode_reward: torch.Tensor
    old_logprobs: torch.Tensor
    moe_routes: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    rm_scores: torch.Tensor
    rule_scores: torch.Tensor
    function_scores: torch.Tensor
    reward_errors: torch.Tensor
    weight_version: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    kl: torch.Tensor
    proximal_logprobs: torch.Tensor


def expected_fields(features: ExperienceFeatures, stage: str) -> frozenset[str]:
    """The fields a batch of ``stage`` holds in a run with ``features``.

    Raises:
        ValueError: an unknown stage.
    """
    if stage not in (SCORED, EXPERIENCE, TRAINING):
        raise ValueError(f"unknown experience stage {stage!r}; one of "
                         f"{[SCORED, EXPERIENCE, TRAINING]}")
    return frozenset(spec.name for spec in FIELDS if stage in spec.stages
                     and (spec.when is None or getattr(features, spec.when)))


def check_experience(batch: Mapping[str, Any], expected: Collection[str], where: str) -> None:
    """Refuse a batch whose fields are not ``expected``, naming each missing field with the
    setting that calls for it and each field nobody expected.

    Raises:
        ValueError: a missing or unexpected field.
    """
    missing = sorted(set(expected) - set(batch))
    unexpected = sorted(set(batch) - set(expected))
    if not missing and not unexpected:
        return
    problems = []
    if missing:
        problems.append("lacks " + ", ".join(f"{name!r} ({_why(name)})" for name in missing))
    if unexpected:
        problems.append("has unexpected " + ", ".join(
            f"{name!r} ({_why(name)})" if name in SPECS else repr(name) for name in unexpected))
    raise ValueError(f"{where}: the experience batch {'; and '.join(problems)}; every field "
                     "is declared in engine/execution/experience_fields.py")


def _why(name: str) -> str:
    spec = SPECS.get(name)
    if spec is None:
        return "undeclared"
    return f"{spec.producer}; " + ("always" if spec.when is None else f"when {spec.when}")

