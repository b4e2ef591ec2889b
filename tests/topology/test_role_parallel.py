"""A role's parallelism has one resolver, ``PlacementConfig.role_parallel``: None inherits the
placement default, a size below 1 (0 included) is refused where the placement is read."""

from __future__ import annotations

import pytest

from megatron_rlhf.topology import ParallelOverride, PlacementConfig, resolve_models
from megatron_rlhf.topology.placement_config import RoleParallel


def test_none_inherits_the_placement_defaults() -> None:
    config = PlacementConfig("separation", tp=2, pp=4, distributed_optimizer=False,
                             parallel={"actor": ParallelOverride(), "critic": {}})
    for role in ("actor", "critic", "ref", "reward"):
        assert config.role_parallel(role) == RoleParallel(tp=2, pp=4, ep=1,
                                                          distributed_optimizer=False), role
    for shadow in ("shadow_actor", "shadow_critic"):
        assert config.role_parallel(shadow) == RoleParallel(tp=2, pp=1, ep=1,
                                                            distributed_optimizer=False), shadow


def test_a_set_field_wins_even_when_falsy() -> None:
    config = PlacementConfig("separation", tp=2, pp=4, parallel={
        "actor": ParallelOverride(tp=1, pp=2, ep=2, distributed_optimizer=False),
        "shadow_actor": {"pp": 2}})
    assert config.role_parallel("actor") == RoleParallel(1, 2, 2, False)
    assert config.role_parallel("shadow_actor") == RoleParallel(2, 2, 1, True)


@pytest.mark.parametrize("name,unset", [("tp", "placement.tp"), ("pp", "placement.pp"),
                                        ("ep", "1")])
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_sizes_below_one_are_refused_not_inherited(name: str, unset: str, value) -> None:
    with pytest.raises(ValueError, match=rf"placement.parallel.ref.{name}={value!r} must be an "
                                         rf"integer >= 1, or unset for {unset}"):
        PlacementConfig(parallel={"ref": {name: value}})


@pytest.mark.parametrize("config", [
    PlacementConfig(tp=2, pp=2),
    PlacementConfig("separation", pp=2, parallel={"actor": ParallelOverride(pp=1)}),
    PlacementConfig("separation", tp=2, parallel={"shadow_actor": ParallelOverride(tp=1, pp=2),
                                                  "critic": ParallelOverride(ep=2)}),
])
def test_the_placement_and_the_run_config_read_the_same_sizes(config: PlacementConfig) -> None:
    """``resolve_models`` (what the run builds) and ``RunConfig``'s routing-replay check (which
    refuses a pipeline-parallel policy) once resolved overrides each their own way; 0 was where
    they parted: the check inherited the default, the build refused it."""
    from megatron_rlhf.config.ppo_run import ModelsConfig, RunConfig
    from megatron_rlhf.models.moe import MoEConfig

    specs = resolve_models(config, "tiny")
    for role, spec in specs.items():
        resolved = config.role_parallel(role)
        assert (spec.tp, spec.pp, spec.ep, spec.distributed_optimizer) == (
            resolved.tp, resolved.pp, resolved.ep, resolved.distributed_optimizer), role
    piped = [role for role in ("actor", "shadow_actor") if role in specs and specs[role].pp > 1]
    models = ModelsConfig(moe=MoEConfig(num_experts=4), sequence_parallel=False)
    if piped:
        with pytest.raises(ValueError, match=f"{piped[0]} pp=2: routing replay"):
            RunConfig(placement=config, models=models)
    else:
        RunConfig(placement=config, models=models)
