"""Old log-probs taken from generation (``rollout.reuse_generation_logprobs``) against the
full forward they replace: the same experience up to rounding, one forward pass fewer."""

from __future__ import annotations

import pytest

from tests.multirank import run_on_ranks

MAX_DIFF = 1e-5
"""Largest |generation - forward| old log-prob accepted; measured about 1e-6 (fp32, tiny model)."""


def _experience_both_ways() -> dict:
    import torch

    from megatron_rlhf.config.ppo_run import ModelsConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment

    initialize_runtime()
    config = RunConfig(models=ModelsConfig(arch="tiny", init_seed=9),
                       rollout=RolloutConfig(prompts_per_step=8, max_prompt_length=8),
                       generation=GenerationConfig(max_new_tokens=10, seed=3, temperature=0.9))
    engine = build_engine(config, make_plan(config, cluster_from_environment()), eos_id=3,
                          pad_id=0)
    forward_passes = []
    compute_log_prob = engine.workers["actor"].compute_log_prob
    engine.workers["actor"].compute_log_prob = lambda *a: (
        forward_passes.append(1), compute_log_prob(*a))[1]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (8,), generator=generator)]
    experiences, passes = {}, {}
    for reuse in (False, True):
        engine.reuse_generation_logprobs = reuse
        forward_passes.clear()
        rollout = engine.generate_rollout(prompts, list(range(8)))
        experiences[reuse] = engine.make_experience(rollout, 0.9).fields
        passes[reuse] = len(forward_passes)
    computed, reused = experiences[False], experiences[True]
    mask = computed["response_mask"].bool()
    return {
        "passes": passes,
        "same_other_fields": computed.keys() == reused.keys() and all(
            torch.equal(computed[k], reused[k]) for k in computed if k != "old_logprobs"),
        "max_diff": (computed["old_logprobs"] - reused["old_logprobs"])[mask].abs().max().item(),
        "tokens": int(mask.sum()),
        "padding_zero": bool((reused["old_logprobs"][~mask] == 0).all()),
    }


@pytest.mark.multirank
def test_generation_logprobs_replace_the_policy_forward_up_to_rounding() -> None:
    (result,) = run_on_ranks(_experience_both_ways, world_size=1, timeout_s=240)
    assert result["passes"] == {False: 1, True: 0}, "the actor computes old log-probs only once"
    assert result["same_other_fields"] and result["padding_zero"]
    assert result["tokens"] > 20
    assert result["max_diff"] <= MAX_DIFF, result["max_diff"]
