"""What each model holds and how it trains, through the whole PPO engine.

* ``models.recompute.<role>`` recomputes activations in training passes only and changes no metric:
  two PPO steps with the actor on ``full`` and the critic on ``selective`` equal, bit for bit,
  the same steps without recomputation (``tests/models/test_recompute.py`` says why).
* Inference-only models (reference, reward model, shadows) hold their weights and nothing else:
  no trainer, no DDP gradient buffer or ``main_grad``, no ``.grad`` after training steps, no
  optimizer state, weights in the run's ``params_dtype`` (bf16 here, as on a GPU by default;
  fp32 main copies exist only in the trainers' optimizers).

Separation on 2 gloo ranks: the trained models on rank 0, the shadows, reference and reward model
on rank 1.
"""

from __future__ import annotations

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig
from tests.engine.two_steps import two_ppo_steps
from tests.multirank import run_on_ranks

RECOMPUTE = {"actor": "full", "critic": "selective"}


@pytest.mark.parametrize(("recompute", "message"), [
    ({"ref": "full"}, r"models.recompute.ref: only trained models recompute activations; use "
                      r"one of \('actor', 'critic'\)"),
    ({"shadow_actor": "full"}, r"models.recompute.shadow_actor: only trained models"),
    ({"actor": "block"}, r"models.recompute.actor='block': use one of \('none', 'selective', "
                         r"'full'\)"),
])
def test_bad_recompute_settings_are_refused(recompute: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelsConfig(recompute=recompute)


def test_only_trained_roles_recompute() -> None:
    from pathlib import Path

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    example = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
    models = load_config(RunConfig, example, ["models.recompute.actor=full"]).models
    assert [models.recompute_of(r) for r in ("actor", "critic", "shadow_actor", "ref")] == [
        "full", "none", "none", "none"]


def _held_state(engine) -> dict[str, dict]:
    """Per model on this rank: the optimizer's parameter dtypes of a trained one; what an
    inference-only one holds besides its weights."""
    from megatron_rlhf.models.offload import GRADS, OPTIMIZER, WEIGHTS

    held = {}
    for role, worker in engine.workers.items():
        if worker.trainer is not None:
            optimizers = getattr(worker.trainer.optimizer, "chained_optimizers",
                                 [worker.trainer.optimizer])
            held[role] = {"main_dtypes": {str(p.dtype) for inner in optimizers
                                          for group in inner.optimizer.param_groups
                                          for p in group["params"]}}
            continue
        params = list(worker.model.parameters())
        held[role] = {
            "grads": [p.grad is not None or hasattr(p, "main_grad") for p in params],
            "dtypes": {str(p.dtype) for p in params},
            "extra_bytes": worker.offloader.resident_bytes((GRADS, OPTIMIZER)),
            "weight_bytes": worker.offloader.resident_bytes((WEIGHTS,)),
            "state_bytes": sum(t.numel() * t.element_size()
                               for t in (*params, *worker.model.buffers())),
        }
    return held


def _run(recompute: dict[str, str]) -> tuple[list[dict], dict, dict[str, str]]:
    from megatron_rlhf.config.ppo_run import RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.topology.placement_config import PlacementConfig

    config = RunConfig(
        placement=PlacementConfig(strategy="separation"),
        models=ModelsConfig(arch="tiny", init_seed=9, params_dtype="bfloat16",
                            recompute=recompute),
        rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=8, micro_batch_size=2),
        generation=GenerationConfig(max_new_tokens=6, seed=3),
        reward=RewardConfig(model_weight=0.5, rule="none"), steps=2)
    config.actor_optimizer.lr = config.critic_optimizer.lr = 1e-3
    engine, metrics = two_ppo_steps(config)
    granularity = {role: worker.model.config.recompute_granularity or "none"
                   for role, worker in engine.workers.items()}
    return metrics, _held_state(engine), granularity


def _both() -> tuple:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return _run({}), _run(RECOMPUTE)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_recompute_changes_no_metric_and_inference_models_hold_only_weights() -> None:
    per_rank = run_on_ranks(_both, world_size=2, timeout_s=540)
    (plain, _, _), (recomputed, trained, granularity) = per_rank[0]
    assert recomputed == plain, "models.recompute changed a PPO metric"
    assert trained == {role: {"main_dtypes": {"torch.float32"}} for role in ("actor", "critic")}
    assert plain[1]["actor/grad_norm"] > 0 and plain[1]["value_loss"] > 0
    assert granularity == {"actor": "full", "critic": "selective"}
    _, (_, held, granularity) = per_rank[1]
    assert set(held) == {"shadow_actor", "shadow_critic", "ref", "reward"}
    assert set(granularity.values()) == {"none"}
    for role, state in held.items():
        assert not any(state["grads"]), f"{role} has gradients"
        assert state["extra_bytes"] == 0, f"{role} holds gradient buffers or optimizer state"
        assert state["weight_bytes"] == state["state_bytes"] > 0, role
        assert state["dtypes"] == {"torch.bfloat16"}, role
