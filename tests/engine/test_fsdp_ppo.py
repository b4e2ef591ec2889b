"""PPO with the actor and critic under Megatron-FSDP gives the resident run's metrics.

Flattening on 2 gloo ranks: both trained models on both ranks (dp=2), two PPO steps from the same
weights and prompts, once with DDP and the distributed optimizer, once with
``actor_optimizer.fsdp=true`` and ``critic_optimizer.fsdp=true``. Generation and the experience
pass run through the FSDP wrapper, which gathers each layer's weights while it computes.
Both runs' Hugging Face exports agree within 1e-6 (the FSDP one gathers the shards first).

A run of 2 steps under FSDP that saves, resumed for steps 2-3 (dropout, an adaptive KL
controller, running score normalisation, LR warm-up), logs the metrics of an uninterrupted 4-step
run to the bit; its checkpoint is refused by a run without FSDP, and at another TP size.
What reads or moves whole weights (shadows, offloading) and layouts the FSDP adapter cannot mesh
are refused before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig, RunConfig
from megatron_rlhf.topology.cluster import DevicePool, cluster_from_environment
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.engine.two_steps import two_ppo_steps
from tests.helpers.metrics import run_metrics
from tests.multirank import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6
"""Metric agreement (observed: 2e-7 relative; the policy loss is ~1e-7 around zero, so absolute)."""
EXPORT_ATOL = 1e-6
"""Exported weights of the FSDP and the resident run after two steps (observed: 0.0, both models:
the two steps give the same weights to the bit)."""


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


def _run(fsdp: bool, export_dir: Path) -> tuple[list[dict], dict[str, int]]:
    """Two PPO steps, then a Hugging Face export of the actor and critic into ``export_dir``."""
    from megatron_rlhf.engine.run.export import HFExporter
    from megatron_rlhf.models.offload import GRADS

    config = _config(fsdp)
    engine, metrics = two_ppo_steps(config)
    grad_bytes = {role: engine.workers[role].offloader.resident_bytes((GRADS,))
                  for role in ("actor", "critic")}
    HFExporter(config, {}, SimpleNamespace(pad_id=0)).export(engine, export_dir)
    return metrics, grad_bytes


def _both(root: str) -> tuple:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return _run(False, Path(root) / "resident"), _run(True, Path(root) / "fsdp")


def _export_diff(root: Path, role: str) -> float:
    from safetensors.torch import load_file

    want = load_file(root / "resident" / role / "model.safetensors")
    got = load_file(root / "fsdp" / role / "model.safetensors")
    assert got.keys() == want.keys() and len(got) > 10
    return max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_fsdp_ppo_steps_and_export_match_the_resident_run(tmp_path: Path) -> None:
    for (resident, resident_grads), (sharded, sharded_grads) in run_on_ranks(
            _both, world_size=2, args=(str(tmp_path),), timeout_s=540):
        assert [m.keys() for m in sharded] == [m.keys() for m in resident]
        for step, (got, want) in enumerate(zip(sharded, resident, strict=True)):
            assert got == pytest.approx(want, rel=RTOL, abs=ATOL), f"step {step}"
        assert resident[1]["actor/grad_norm"] > 0 and resident[1]["value_loss"] > 0
        for role, held in sharded_grads.items():
            # Each rank keeps half of the gradient buffer, padded to the shard alignment.
            assert 0.45 <= held / resident_grads[role] <= 0.55, (role, held, resident_grads)
    for role in ("actor", "critic"):
        diff = _export_diff(tmp_path, role)
        assert diff <= EXPORT_ATOL, (role, diff)


@pytest.mark.parametrize(("changes", "message"), [
    ({"placement": PlacementConfig(strategy="separation")},
     r"actor_optimizer.fsdp=true: placement.strategy='separation' copies the actor's whole "
     r"weights into a shadow"),
    ({"models": ModelsConfig(arch="tiny", offload={"critic": "auto"})},
     r"critic_optimizer.fsdp=true: models.offload.critic='auto' moves the model's storages"),
])
def test_what_needs_whole_weights_is_refused_with_fsdp(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(True, **changes)


def _resume_config(root: str, name: str, steps: int, fsdp: bool = True, **checkpoint):
    from megatron_rlhf.config.ppo_run import CheckpointConfig, RolloutConfig

    config = _config(fsdp, models=ModelsConfig(arch="tiny", init_seed=9, dropout=0.1),
                     rollout=RolloutConfig(prompts_per_step=8, max_prompt_length=16,
                                           micro_batch_size=2, num_minibatches=2),
                     checkpoint=CheckpointConfig(**checkpoint), steps=steps,
                     run_dir=f"{root}/{name}")
    config.reward.rule = "synthetic"
    config.algorithm.adaptive_kl = True
    config.algorithm.kl_target = 0.01
    config.algorithm.kl_horizon = 16
    config.algorithm.reward_norm = "running"
    for settings in (config.actor_optimizer, config.critic_optimizer):
        # The schedule must not depend on config.steps, which the interrupted run shortens.
        settings.lr_schedule, settings.lr_warmup_steps, settings.lr_decay_steps = "linear", 3, 8
    return config


def _resume(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo

    run_ppo(_resume_config(root, "A", steps=4))
    run_ppo(_resume_config(root, "B", steps=2, save_dir=f"{root}/ckpt"))
    run_ppo(_resume_config(root, "B", steps=4, save_dir=f"{root}/ckpt", resume=True))
    out: dict = {}
    if dist.get_rank() == 0:
        out["metrics"] = (run_metrics(f"{root}/A"), run_metrics(f"{root}/B"))
        out["saved"] = sorted(p.name for p in Path(root, "ckpt").iterdir())
    for name, fsdp, tp in (("resident", False, 1), ("tp2", True, 2)):
        config = _resume_config(root, name, steps=3, fsdp=fsdp,
                                resume_from=f"{root}/ckpt/step_00000002")
        config.placement.tp = tp
        try:
            run_ppo(config)
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    return out


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_fsdp_run_resumes_bit_exactly_and_refuses_another_sharding(tmp_path: Path) -> None:
    results = run_on_ranks(_resume, world_size=2, args=(str(tmp_path),), timeout_s=540)
    uninterrupted, resumed = results[0]["metrics"]
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    assert resumed == uninterrupted, "the resumed run's metrics differ from the uninterrupted run"
    assert results[0]["saved"] == ["step_00000002", "step_00000004"]
    for rank in results:
        assert ("was saved with actor_optimizer.fsdp=true but this run has "
                "actor_optimizer.fsdp=false" in rank["resident"]), rank["resident"]
        assert "resume with actor_optimizer.fsdp=true" in rank["resident"]
        assert ("holds the actor under Megatron-FSDP at tp=1, this run places it at tp=2"
                in rank["tp2"]), rank["tp2"]
        assert "resume with placement.tp=1" in rank["tp2"]


def test_a_dist_checkpoint_is_refused_by_an_fsdp_run() -> None:
    from megatron_rlhf.engine.run.checkpointing import _check_same_sharding
    from megatron_rlhf.models.checkpoint import CheckpointInfo, ModelDescription
    from megatron_rlhf.topology.models import ArchSpec

    arch = ArchSpec("t", 2, 64, 4, 250, 64, 128, gated_mlp=True, num_query_groups=2)
    info = CheckpointInfo(ModelDescription(arch), tp_size=1, pp_size=1,
                          metadata={"role": "critic", "step": 2})
    with pytest.raises(ValueError, match=r"ckpt/critic was saved with critic_optimizer.fsdp=false "
                                         r"but this run has critic_optimizer.fsdp=true.*resume "
                                         r"with critic_optimizer.fsdp=false"):
        _check_same_sharding(info, Path("ckpt/critic"), "critic", fsdp=True, tp=1)
    _check_same_sharding(info, Path("ckpt/critic"), "critic", fsdp=False, tp=2)


def test_a_placement_fsdp_cannot_mesh_is_refused() -> None:
    from megatron_rlhf.engine.run.build import make_plan

    config = _config(True, placement=PlacementConfig(strategy="interleaving2"))
    cluster = cluster_from_environment([DevicePool("local", nodes=1, devices_per_node=4)])
    with pytest.raises(ValueError, match=r"actor_optimizer.fsdp=true needs the actor on all 4 "
                                         r"ranks with pp=1 .* gives it 2 ranks with pp=1"):
        make_plan(config, cluster)
