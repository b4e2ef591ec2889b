"""PPO and GRPO steps of a tiny mixture-of-experts model (4 experts, top-2) in every role, built
inside a multi-rank test: random prompts of 2-8 tokens, the engine and the algorithm; callers
choose the placement, the expert-parallel sizes and the batching."""

from __future__ import annotations

from typing import Any

PROMPTS = 4
"""Prompts per step."""


def moe_steps(estimator: str, strategy: str, *, grpo_samples: int, num_minibatches: int,
              eps: dict[str, int] | None = None, steps: int = 2, prompt_steps: int = 2,
              **generation: Any) -> tuple[Any, Any]:
    """``(engine, algorithm)`` of ``steps`` steps of ``estimator`` (``gae`` or ``grpo``, with
    ``grpo_samples`` samples per prompt) under ``strategy``, each role at expert-parallel size
    ``eps[role]`` (1 when absent), with prompts for ``prompt_steps`` steps; ``generation`` adds
    ``GenerationConfig`` fields."""
    import torch

    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.models.moe import MoEConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.placement_config import ParallelOverride, PlacementConfig
    from tests.helpers.metrics import even_token_share

    initialize_runtime()
    generator = torch.Generator().manual_seed(0)
    # prompts of 2 to 8 tokens: ranks' rows differ in length, so their token-budget
    # micro-batches and their decode steps (end-of-sequence at different steps) differ
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (PROMPTS * prompt_steps,), generator=generator)]
    grpo = estimator == "grpo"
    config = RunConfig(
        placement=PlacementConfig(strategy=strategy, parallel={
            role: ParallelOverride(ep=ep) for role, ep in (eps or {}).items()}),
        models=ModelsConfig(arch="tiny", init_seed=9,
                            moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=128)),
        rollout=RolloutConfig(prompts_per_step=PROMPTS,
                              samples_per_prompt=grpo_samples if grpo else 1,
                              max_prompt_length=8, micro_batch_size=1, ppo_epochs=1,
                              num_minibatches=num_minibatches),
        generation=GenerationConfig(max_new_tokens=6, seed=3, **generation),
        reward=RewardConfig(model_weight=0.5, rule="none", rule_weight=1.0),
        algorithm=(PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss",
                                      kl_loss_coef=0.05) if grpo else PPOAlgorithmConfig()),
        steps=steps)
    config.actor_optimizer.lr = 1e-3
    engine = build_engine(config, make_plan(config, cluster_from_environment(None)),
                          eos_id=3, pad_id=0)
    algorithm = PPOAlgorithm(
        engine, config.algorithm, config.rollout, config.reward, seed=5, total_steps=steps,
        prompts=lambda step, _round=0: (prompts[PROMPTS * step:PROMPTS * (step + 1)],
                                        list(range(PROMPTS * step, PROMPTS * (step + 1)))),
        rule_reward=even_token_share)
    return engine, algorithm
