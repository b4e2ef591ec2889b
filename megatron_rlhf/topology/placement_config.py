"""How the user asks for a placement: a named strategy or a ratio list, plus parallelism.

    PlacementConfig(strategy="separation", tp=8)
    PlacementConfig(strategy="custom", ratios=[1, 1, 0.5, 0.5])
    PlacementConfig(strategy="interleaving", tp=2, parallel={"ref": ParallelOverride(tp=1)})

The run configuration embeds one ``PlacementConfig``; ``plan_placement`` turns it into ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    ROLES,
    SHADOW_CRITIC,
    SHADOW_OF,
)

FLATTENING = "flattening"
INTERLEAVING = "interleaving"
INTERLEAVING2 = "interleaving2"
SEPARATION = "separation"
HETERO_SEPARATION = "hetero-separation"
CUSTOM = "custom"

STRATEGIES = (FLATTENING, INTERLEAVING, INTERLEAVING2, SEPARATION, HETERO_SEPARATION, CUSTOM)

RATIO_ROLES = (ACTOR, CRITIC, REF, REWARD)
"""Order of the entries of a ratio list."""

CRITIC_FREE_RATIO_ROLES = (ACTOR, REF, REWARD)
"""Order of the entries of a ratio list when no critic is placed (``critic=False``)."""

PRESET_RATIOS: dict[str, tuple[float, float, float, float]] = {
    FLATTENING: (1.0, 1.0, 1.0, 1.0),
    INTERLEAVING: (1.0, 1.0, 0.5, 0.5),
    INTERLEAVING2: (0.5, 0.5, 0.5, 0.5),
}
"""Ratio lists of the single-region presets, over ``RATIO_ROLES``."""

CRITIC_FREE_PRESET_RATIOS: dict[str, tuple[float, float, float]] = {
    FLATTENING: (1.0, 1.0, 1.0),
    INTERLEAVING: (1.0, 0.5, 0.5),
}
"""Presets over ``CRITIC_FREE_RATIO_ROLES``; interleaving2 (actor || critic) has no meaning."""

DISJOINT_ROLES: dict[str, tuple[tuple[str, str], ...]] = {
    INTERLEAVING: ((REF, REWARD),),
    INTERLEAVING2: ((REF, REWARD), (ACTOR, CRITIC)),
}
"""Pairs a strategy promises to run side by side, hence on disjoint devices."""

SEPARATED = (SEPARATION, HETERO_SEPARATION)


@dataclass
class ParallelOverride:
    """Per-role parallelism that replaces the placement-wide defaults.

    None inherits the default (``PlacementConfig.role_parallel`` resolves it); a size below 1,
    0 included, is refused.

    Attributes:
        tp: tensor-parallel size, or None for ``placement.tp``.
        pp: pipeline-parallel size, or None for ``placement.pp`` (1 for a shadow).
        distributed_optimizer: shard optimizer state over DP, or None for the default.
        ep: expert-parallel size of a mixture-of-experts model (``models.moe``), or None for 1:
            its experts are split over groups of ``ep`` of its data-parallel ranks, which
            exchange tokens with an all-to-all. Must divide the model's DP size and the number
            of experts; the expert TP is the model's TP.
    """

    tp: int | None = None
    pp: int | None = None
    distributed_optimizer: bool | None = None
    ep: int | None = None


@dataclass(frozen=True)
class RoleParallel:
    """A role's effective parallelism: its ``ParallelOverride`` over the placement defaults."""

    tp: int
    pp: int
    ep: int
    distributed_optimizer: bool


@dataclass
class ReplanConfig:
    """Re-planning during a run: every ``interval_steps`` steps the planner ranks the candidate
    placements again with the stage times and answer lengths the run measured, and records the
    ranking (``replan/*`` metrics, ``<run_dir>/plan_history.jsonl``). With ``move`` the run
    also moves to the best placement, inside the job, when that pays for the move.

    Attributes:
        interval_steps: steps measured per re-planning; 0 turns it off.
        min_gain: the predicted saving, as a fraction of the current step time, above which a
            move is reported as paying (``replan/would_move``).
        warmup_steps: first steps of the run left out of the measurements (start-up costs).
        profile: hardware profile the planner starts from (a shipped name or a
            ``tools/calibrate.py`` JSON); None: the shipped profile named like each pool's kind.
        move: move the run to the best placement after a re-planning whose predicted saving
            over the steps ahead (``horizon_steps``) exceeds ``min_gain`` of their predicted
            time plus the cost of a move (the last move's measured seconds; before the first,
            an estimate). The run saves its state, builds the new placement and loads the
            state into it at the step boundary, in the same processes.
        horizon_steps: the steps a move's saving is counted over: the steps left in the run,
            at most this many; 0: all of them (a move that pays over the run is taken at the
            first re-planning that predicts it).
        trial_margin: with ``move``, a measured trial where the planner cannot tell two
            placements apart: when the first re-planning predicts the best other candidate
            within this share of the run's own step (and the steps left repay the trial), the
            run moves there, measures it, and the next re-planning decides between the two
            from measurements (a placement left is priced at its measured step); once per run.
            0 (the default) turns trials off.
    """

    interval_steps: int = 0
    min_gain: float = 0.05
    warmup_steps: int = 1
    profile: str | None = None
    move: bool = False
    horizon_steps: int = 0
    trial_margin: float = 0.0

    def __post_init__(self) -> None:
        for name in ("interval_steps", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"placement.replan.{name}={value!r} must be an integer >= 0 "
                                 f"(placement.replan.interval_steps=0 turns re-planning off)")
        if not isinstance(self.min_gain, int | float) or not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"placement.replan.min_gain={self.min_gain!r} must be a fraction in "
                             "[0, 1) of the step time, e.g. 0.05")
        if (not isinstance(self.horizon_steps, int) or isinstance(self.horizon_steps, bool)
                or self.horizon_steps < 0):
            raise ValueError(f"placement.replan.horizon_steps={self.horizon_steps!r} must be an "
                             "integer >= 0 (0: the steps left in the run)")
        if not isinstance(self.move, bool):
            raise ValueError(f"placement.replan.move={self.move!r} must be true or false")
        if (not isinstance(self.trial_margin, int | float) or isinstance(self.trial_margin, bool)
                or not 0.0 <= self.trial_margin < 1.0):
            raise ValueError(f"placement.replan.trial_margin={self.trial_margin!r} must be a "
                             "fraction in [0, 1) of the step time, e.g. 0.1 (0 turns trials off)")
        if self.trial_margin and not self.move:
            raise ValueError(f"placement.replan.trial_margin={self.trial_margin} tries a "
                             "placement by moving to it: set placement.replan.move=true, or "
                             "placement.replan.trial_margin=0")
        if self.move and not self.interval_steps:
            raise ValueError("placement.replan.move=true needs re-planning: set "
                             "placement.replan.interval_steps above 0 (e.g. 10)")

    @property
    def enabled(self) -> bool:
        """Whether the run re-plans at all."""
        return self.interval_steps > 0


@dataclass
class PlacementConfig:
    """A placement request, validated on construction.

    Attributes:
        strategy: one of ``STRATEGIES``. ``custom`` takes ``ratios``.
        ratios: fraction of devices per model over ``[actor, critic, ref, reward]``, each in
            (0, 1]; only with ``strategy="custom"``. Under AC-Share the critic entry is unused;
            without a critic (``critic=False``) the list is ``[actor, ref, reward]``. Without a
            reward model (``reward=False``) the list keeps its length and its reward entry is
            unused, so a run switches its reward model off without rewriting its ratios.
        train_fraction: under ``separation``, the fraction of nodes (of devices on a one-node
            cluster) that hold the trainable actor and critic; the rest hold the shadows, ref
            and reward.
        ac_share: the critic is a value head on the actor (AC-Share): no critic and no shadow
            critic are placed.
        critic: a value model is used at all. False for the critic-free estimators (grpo, rloo,
            reinforce++): actor, ref and reward are placed (and a shadow actor under
            separation), nothing else. ``RunConfig`` sets it from
            ``algorithm.advantage_estimator``.
        reward: a reward model is used at all. False when the score comes from rules and
            reward functions alone (``reward.model_weight=0``): no reward model is placed or
            run, the reference's ranks score the answers (the actor's when its base is the
            reference). ``RunConfig`` sets it from ``reward.model_weight``.
        reference: a reference model is placed. False when the actor's frozen base, its LoRA
            adapters switched off, gives the reference log-probs (``models.lora`` on the
            actor): no reference model is placed or built, a ratio list keeps its length and
            its ref entry is unused. ``RunConfig`` sets it from ``models.lora``.
        tp: default tensor-parallel size of every model.
        pp: default pipeline-parallel size of every model except the shadows, which default to
            ``pp=1`` (generation wants no pipeline bubbles).
        distributed_optimizer: default for the trainable models.
        parallel: per-role overrides, keyed by role name (``shadow_actor`` included): ``tp``,
            ``pp``, ``distributed_optimizer`` and, for a mixture-of-experts model, ``ep`` (its
            expert-parallel size, default 1); plain mappings (as read from YAML) are turned
            into ``ParallelOverride``.
        train_pool: under ``hetero-separation``, the pool kind for actor and critic; default the
            fastest pool other than the inference pool.
        inference_pool: under ``hetero-separation``, the pool kind for the inference-only
            models; default the slowest pool (the last of equals).
        replan: re-planning during the run (off by default); a plain mapping (as read from
            YAML) is turned into ``ReplanConfig``.
    """

    strategy: str = FLATTENING
    ratios: list[float] | None = None
    train_fraction: float = 0.5
    ac_share: bool = False
    critic: bool = True
    reward: bool = True
    reference: bool = True
    tp: int = 1
    pp: int = 1
    distributed_optimizer: bool = True
    parallel: dict[str, ParallelOverride] = field(default_factory=dict)
    train_pool: str | None = None
    inference_pool: str | None = None
    replan: ReplanConfig = field(default_factory=ReplanConfig)

    def __post_init__(self) -> None:
        if isinstance(self.replan, dict):
            unknown = sorted(set(self.replan) - set(ReplanConfig.__dataclass_fields__))
            if unknown:
                raise ValueError(f"placement.replan has unknown keys {unknown}: use "
                                 f"{list(ReplanConfig.__dataclass_fields__)}")
            self.replan = ReplanConfig(**self.replan)
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"placement.strategy={self.strategy!r} is unknown: choose one of {STRATEGIES}"
            )
        self._check_critic_free()
        self._check_reward_free()
        self._check_reference_free()
        self._check_ratios()
        if not 0.0 < self.train_fraction < 1.0:
            raise ValueError(
                f"placement.train_fraction={self.train_fraction} must be in (0, 1), e.g. 0.5"
            )
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"placement.{name}={value!r} must be an integer >= 1")
        self.parallel = {role: _override(role, o) for role, o in self.parallel.items()}
        for role, override in self.parallel.items():
            for name, unset in (("tp", "placement.tp"), ("pp", "placement.pp (1 for a shadow)"),
                                ("ep", "1")):
                value = getattr(override, name)
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ValueError(f"placement.parallel.{role}.{name}={value!r} must be an "
                                     f"integer >= 1, or unset for {unset}")
        unknown = sorted(set(self.parallel) - set(ROLES))
        if unknown:
            raise ValueError(
                f"placement.parallel has unknown roles {unknown}: use roles from {ROLES}"
            )
        if (self.train_pool or self.inference_pool) and self.strategy != HETERO_SEPARATION:
            raise ValueError(
                f"placement.train_pool/inference_pool are set but strategy={self.strategy!r}: "
                f"they only apply to strategy={HETERO_SEPARATION!r}"
            )

    def _check_critic_free(self) -> None:
        if self.critic:
            return
        if self.ac_share:
            raise ValueError(
                "placement.ac_share=true puts a critic's value head on the actor, but this run has "
                "no critic (its algorithm.advantage_estimator is critic-free): drop "
                "placement.ac_share, or use advantage_estimator='gae'"
            )
        if self.strategy == INTERLEAVING2:
            raise ValueError(
                "placement.strategy='interleaving2' trains actor and critic side by side, but "
                "this run has no critic (its algorithm.advantage_estimator is critic-free): "
                "use 'interleaving', or strategy='custom' with ratios over "
                f"{list(CRITIC_FREE_RATIO_ROLES)}"
            )
        for role in self.parallel:
            if role in (CRITIC, SHADOW_CRITIC):
                raise ValueError(
                    f"placement.parallel[{role!r}] is set, but this run places no {role} "
                    "(its algorithm.advantage_estimator is critic-free): drop it"
                )

    def _check_reward_free(self) -> None:
        if not self.reward and REWARD in self.parallel:
            raise ValueError(
                "placement.parallel['reward'] is set, but this run places no reward model "
                "(reward.model_weight=0): drop it, or set reward.model_weight > 0")

    def _check_reference_free(self) -> None:
        if not self.reference and REF in self.parallel:
            raise ValueError(
                "placement.parallel['ref'] is set, but this run places no reference model (the "
                "actor's base with its LoRA adapters off is the reference, models.lora): drop it")

    @property
    def ratio_roles(self) -> tuple[str, ...]:
        """The roles a ratio list names, in order: with or without the critic."""
        return RATIO_ROLES if self.critic else CRITIC_FREE_RATIO_ROLES

    def _check_ratios(self) -> None:
        if self.strategy != CUSTOM:
            if self.ratios is not None:
                raise ValueError(
                    f"placement.ratios={self.ratios} is set but strategy={self.strategy!r}: "
                    f"set strategy={CUSTOM!r} or drop the ratios"
                )
            return
        if self.ratios is not None and not self.critic and len(self.ratios) == len(RATIO_ROLES):
            raise ValueError(
                f"placement.ratios={self.ratios} gives a critic ratio, but this run has no critic "
                "(its algorithm.advantage_estimator is critic-free): give "
                f"{len(CRITIC_FREE_RATIO_ROLES)} ratios for {list(CRITIC_FREE_RATIO_ROLES)}, "
                "e.g. [1, 0.5, 0.5]"
            )
        # A critic-free list is accepted before RunConfig sets critic=False from the algorithm;
        # role_ratios() refuses it if a critic is still placed then.
        if self.ratios is None or len(self.ratios) not in (len(RATIO_ROLES),
                                                           len(CRITIC_FREE_RATIO_ROLES)):
            raise ValueError(
                f"placement.ratios={self.ratios} must give {len(RATIO_ROLES)} ratios for "
                f"{list(RATIO_ROLES)}, e.g. [1, 1, 0.5, 0.5] ({len(CRITIC_FREE_RATIO_ROLES)} for "
                f"{list(CRITIC_FREE_RATIO_ROLES)} with a critic-free advantage_estimator)"
            )
        roles = RATIO_ROLES if len(self.ratios) == len(RATIO_ROLES) else CRITIC_FREE_RATIO_ROLES
        for role, ratio in zip(roles, self.ratios, strict=True):
            if not 0.0 < ratio <= 1.0:
                raise ValueError(
                    f"placement.ratios: {role} ratio {ratio} must be in (0, 1]: a model needs "
                    "some devices and cannot have more than all of them"
                )

    @property
    def places_critic(self) -> bool:
        """Whether a critic network is placed (neither AC-Share nor a critic-free run)."""
        return self.critic and not self.ac_share

    @property
    def base_roles(self) -> tuple[str, ...]:
        """The roles placed besides the shadows, in role order: the actor always, the critic
        when ``places_critic``, ref when ``reference``, the reward model when ``reward``."""
        dropped = {CRITIC: not self.places_critic, REF: not self.reference,
                   REWARD: not self.reward}
        return tuple(role for role in RATIO_ROLES if not dropped.get(role))

    @property
    def separated(self) -> bool:
        """Whether the strategy places inference-only shadow copies of actor and critic."""
        return self.strategy in SEPARATED

    def role_ratios(self) -> dict[str, float]:
        """Ratio per role for the single-region strategies; empty under separation."""
        if self.strategy == CUSTOM:
            ratios = self.ratios or ()
            if len(ratios) != len(self.ratio_roles):
                raise ValueError(
                    f"placement.ratios={self.ratios} names {list(CRITIC_FREE_RATIO_ROLES)} (a "
                    "critic-free run) but a critic is placed (algorithm.advantage_estimator="
                    f"'gae'): give {len(RATIO_ROLES)} ratios for {list(RATIO_ROLES)}, or choose "
                    "a critic-free advantage_estimator"
                )
            return dict(zip(self.ratio_roles, ratios, strict=True))
        presets = PRESET_RATIOS if self.critic else CRITIC_FREE_PRESET_RATIOS
        return dict(zip(self.ratio_roles, presets.get(self.strategy, ()), strict=False))

    def role_parallel(self, role: str) -> RoleParallel:
        """The parallelism ``role`` runs with: each field of ``parallel[role]`` that is set, else
        the placement-wide default (``pp=1`` for a shadow, ``ep=1``)."""
        override = self.parallel.get(role) or ParallelOverride()
        default_pp = 1 if role in SHADOW_OF else self.pp
        return RoleParallel(
            tp=self.tp if override.tp is None else override.tp,
            pp=default_pp if override.pp is None else override.pp,
            ep=1 if override.ep is None else override.ep,
            distributed_optimizer=(self.distributed_optimizer
                                   if override.distributed_optimizer is None
                                   else override.distributed_optimizer),
        )

    def to_dict(self) -> dict:
        """JSON-ready description."""
        return {
            "strategy": self.strategy, "ratios": self.ratios,
            "train_fraction": self.train_fraction, "ac_share": self.ac_share,
            "critic": self.critic, "reward": self.reward, "reference": self.reference,
            "tp": self.tp, "pp": self.pp, "distributed_optimizer": self.distributed_optimizer,
            "parallel": {role: vars(o).copy() for role, o in sorted(self.parallel.items())},
            "train_pool": self.train_pool, "inference_pool": self.inference_pool,
        }


def _override(role: str, value: ParallelOverride | dict) -> ParallelOverride:
    """A ``ParallelOverride`` from itself or from a plain mapping read from YAML."""
    if isinstance(value, ParallelOverride):
        return value
    unknown = sorted(set(value) - {"tp", "pp", "distributed_optimizer", "ep"})
    if unknown:
        raise ValueError(
            f"placement.parallel[{role!r}] has unknown keys {unknown}: use tp, pp, "
            "distributed_optimizer, ep"
        )
    return ParallelOverride(**value)
