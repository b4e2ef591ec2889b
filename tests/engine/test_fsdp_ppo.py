"""PPO with the actor and critic under Megatron-FSDP gives the resident run's metrics.

Flattening on 2 gloo ranks: both trained models on both ranks (dp=2), two PPO steps from the same
weights and prompts, once with DDP and the distributed optimizer, once with
``actor_optimizer.fsdp=true`` and ``critic_optimizer.fsdp=true``. Generation and the experience
pass run through the FSDP wrapper, which gathers each layer's weights while it computes.
What reads or moves whole weights (shadows, offloading, checkpoints, Hugging Face export) and
layouts the FSDP adapter cannot mesh are refused before anything is built.
"""

from __future__ import annotations

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig, RunConfig
from megatron_rlhf.topology.cluster import DevicePool, cluster_from_environment
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.engine.two_steps import two_ppo_steps
from tests.multirank import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6
"""Metric agreement (observed: 2e-7 relative; the policy loss is ~1e-7 around zero, so absolute)."""


def _config(fsdp: bool, **changes) -> RunConfig:
    from megatron_rlhf.config.ppo_run import RewardConfig, RolloutConfig
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.models.trainer import OptimizerSettings

    settings = OptimizerSettings(lr=1e-3, fsdp=fsdp)
    fields = dict(
        placement=PlacementConfig(strategy="flattening"),
        models=ModelsConfig(arch="tiny", init_seed=9),
        rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=8, micro_batch_size=2),
        generation=GenerationConfig(max_new_tokens=6, seed=3),
        reward=RewardConfig(model_weight=0.5, rule="none"), steps=2,
        actor_optimizer=settings, critic_optimizer=settings)
    return RunConfig(**{**fields, **changes})


def _run(fsdp: bool) -> tuple[list[dict], dict[str, int]]:
    from megatron_rlhf.models.offload import GRADS

    engine, metrics = two_ppo_steps(_config(fsdp))
    grad_bytes = {role: engine.workers[role].offloader.resident_bytes((GRADS,))
                  for role in ("actor", "critic")}
    return metrics, grad_bytes


def _both() -> tuple:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return _run(fsdp=False), _run(fsdp=True)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_fsdp_ppo_steps_match_the_resident_run() -> None:
    for (resident, resident_grads), (sharded, sharded_grads) in run_on_ranks(
            _both, world_size=2, timeout_s=540):
        assert [m.keys() for m in sharded] == [m.keys() for m in resident]
        for step, (got, want) in enumerate(zip(sharded, resident, strict=True)):
            assert got == pytest.approx(want, rel=RTOL, abs=ATOL), f"step {step}"
        assert resident[1]["actor/grad_norm"] > 0 and resident[1]["value_loss"] > 0
        for role, held in sharded_grads.items():
            # Each rank keeps half of the gradient buffer, padded to the shard alignment.
            assert 0.45 <= held / resident_grads[role] <= 0.55, (role, held, resident_grads)


@pytest.mark.parametrize(("changes", "message"), [
    ({"placement": PlacementConfig(strategy="separation")},
     r"actor_optimizer.fsdp=true: placement.strategy='separation' copies the actor's whole "
     r"weights into a shadow"),
    ({"models": ModelsConfig(arch="tiny", offload={"critic": "auto"})},
     r"critic_optimizer.fsdp=true: models.offload.critic='auto' moves the model's storages"),
    ({"models": ModelsConfig(arch="tiny", export_hf=True)},
     r"actor_optimizer.fsdp=true: models.export_hf reads the actor's whole weights"),
])
def test_what_needs_whole_weights_is_refused_with_fsdp(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(True, **changes)


def test_run_checkpoints_are_refused_with_fsdp() -> None:
    from megatron_rlhf.config.loader import load_config

    with pytest.raises(ValueError, match=r"actor_optimizer.fsdp=true: run checkpoints"):
        load_config(RunConfig, None, ["actor_optimizer.fsdp=true", "checkpoint.save_dir=ckpt"])


def test_a_placement_fsdp_cannot_mesh_is_refused() -> None:
    from megatron_rlhf.engine.build import make_plan

    config = _config(True, placement=PlacementConfig(strategy="interleaving2"))
    cluster = cluster_from_environment([DevicePool("local", nodes=1, devices_per_node=4)])
    with pytest.raises(ValueError, match=r"actor_optimizer.fsdp=true needs the actor on all 4 "
                                         r"ranks with pp=1 .* gives it 2 ranks with pp=1"):
        make_plan(config, cluster)
