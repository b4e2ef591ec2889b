"""Two PPO steps of a configuration on fixed prompts, for tests that compare engine settings."""

from __future__ import annotations

from megatron_rlhf.config.ppo_run import RunConfig


def two_ppo_steps(config: RunConfig):
    """Build the engine for ``config`` on this job's ranks and run PPO steps 0 and 1 on eight
    fixed 3-token prompts (four a step); returns ``(engine, metrics of each step)``."""
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.topology.cluster import cluster_from_environment

    engine = build_engine(config, make_plan(config, cluster_from_environment(None)),
                          eos_id=3, pad_id=0)
    prompts = [[5 + i, 7 + i, 9] for i in range(8)]
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                             prompts=lambda s: (prompts[4 * s:4 * s + 4], list(range(4))),
                             total_steps=2)
    return engine, [algorithm.step(step) for step in range(2)]
