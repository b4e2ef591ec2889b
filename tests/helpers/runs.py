"""Whole PPO runs inside multi-rank tests: a small separation configuration, the engine a run
built, its trained weights, and a run against its resumed self."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def separation_config(root: str, name: str, steps: int, dropout: float = 0.0,
                      checkpoint: dict[str, Any] | None = None, **fields: Any):
    """A small PPO run of the tiny model under separation, writing to ``root/name``, with the
    given ``checkpoint.*`` settings and other ``RunConfig`` fields; callers add what their test
    needs."""
    from megatron_rlhf.config.ppo_run import (
        CheckpointConfig,
        ModelsConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
    )
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig
    from megatron_rlhf.runtime.distributed import DistributedConfig
    from megatron_rlhf.topology.placement_config import PlacementConfig

    return RunConfig(
        runtime=RuntimeConfig(seed=7, distributed=DistributedConfig(timeout_s=60)),
        placement=PlacementConfig(strategy="separation"),
        models=ModelsConfig(arch="tiny", init_seed=9, dropout=dropout),
        rollout=RolloutConfig(prompts_per_step=8, max_prompt_length=16, micro_batch_size=2,
                              ppo_epochs=1, num_minibatches=2),
        generation=GenerationConfig(max_new_tokens=6, seed=3),
        reward=RewardConfig(model_weight=0.5, rule="synthetic"),
        checkpoint=CheckpointConfig(**(checkpoint or {})), steps=steps, run_dir=f"{root}/{name}",
        **fields)


def capture_engine() -> dict:
    """Keep the engine of every later ``run_ppo`` of this process in the returned dict
    (``["engine"]``, the last one's)."""
    from megatron_rlhf.engine.run import runner

    captured: dict = {}
    if not hasattr(runner, "_original_build_engine"):
        runner._original_build_engine = runner.build_engine

    def capture(*args, **kwargs):
        captured["engine"] = runner._original_build_engine(*args, **kwargs)
        return captured["engine"]

    runner.build_engine = capture
    return captured


def trained_weights(engine) -> dict:
    """Copies of this rank's actor and critic weights."""
    return {f"{role}.{key}": value.detach().clone()
            for role in ("actor", "critic") if role in engine.workers
            for key, value in engine.workers[role].model.state_dict().items()
            if hasattr(value, "detach")}


def run_killed_while_saving_step_2(fn: Callable[[str], None], world_size: int, root: Path,
                                   timeout_s: float) -> None:
    """Run ``fn(root)`` on ranks that SIGKILL themselves while saving step 2 into
    ``root/ckpt``; check that step 1 is complete and step 2 only a temp dir."""
    import pytest

    from tests.multirank import MultiRankError, run_on_ranks

    with pytest.raises(MultiRankError, match="code -9"):
        run_on_ranks(fn, world_size=world_size, args=(str(root),), timeout_s=timeout_s)
    save_dir = root / "ckpt"
    assert (save_dir / "step_00000001" / "manifest.json").is_file()
    assert not (save_dir / "step_00000002").exists()
    assert list(save_dir.glob("step_00000002.tmp-*")), "the killed save left its temp directory"


def whole_and_resumed(config: Callable[..., Any], root: Path, *whole: str) -> dict[str, list]:
    """Metrics of a 2-step run uninterrupted (``whole``: its extra overrides) and of the same
    run stopped after step 1 with a checkpoint and resumed from it; ``config(root, name,
    *overrides)`` makes each run's configuration."""
    from megatron_rlhf.engine.run.runner import run_ppo
    from tests.helpers.metrics import run_metrics

    run_ppo(config(root, "whole", *whole))
    save = f"checkpoint.save_dir={root / 'ckpt'}"
    run_ppo(config(root, "resumed", "steps=1", save, "checkpoint.save_interval=1"))
    run_ppo(config(root, "resumed", save, "checkpoint.resume=latest"))
    return {"whole": run_metrics(root / "whole"), "resumed": run_metrics(root / "resumed")}
