"""Asynchronous separation resumes bit for bit: 4 steps == 2 steps + resume + 2 steps, with the
experience the shadows produced ahead stored in the checkpoint (pipelined in 2 chunks, with
dropout so that the RNG streams matter, an adaptive KL controller and PPO-ptx; and GRPO with 2
samples per prompt and dynamic sampling's refill rounds; off-policy corrections on both; and
GRPO with partial rollouts handed over at a fixed stop check, answers in flight across it; and
with answers that go on across steps, which a save restarts, so the resume continues the run
that saved).
Leaving the stored experience out of the resume changes the steps after it,
so the test can fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.metrics import run_metrics
from tests.multirank import run_on_ranks


def _config(root: str, name: str, algorithm: str, steps: int, **checkpoint):
    from megatron_rlhf.config.ppo_run import (
        CheckpointConfig,
        ModelsConfig,
        PTXConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
    )
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig
    from megatron_rlhf.topology.placement_config import PlacementConfig

    continued = algorithm == "continued"
    grpo, partial = algorithm in ("grpo", "partial", "continued"), algorithm != "grpo"
    partial = partial and algorithm != "ppo"
    config = RunConfig(
        runtime=RuntimeConfig(seed=7),
        placement=PlacementConfig(strategy="separation"),
        models=ModelsConfig(arch="tiny", init_seed=9, dropout=0.1),
        rollout=RolloutConfig(prompts_per_step=4 if grpo else 8, samples_per_prompt=2 if grpo
                              else 1, max_prompt_length=16, micro_batch_size=1,
                              num_minibatches=2, pipeline_chunks=1 if partial else 2,
                              async_rollout=True, max_staleness=3 if continued else 1,
                              reuse_generation_logprobs=partial, partial_rollouts=partial,
                              partial_handover_check=2 if partial else 0,
                              continue_answers=continued),
        # Partial rollouts take the weights at the 2nd stop check, after 4 decode steps.
        # Answers that go on across steps end at any of 64 tokens: their lengths vary, and
        # the oldest outlive their step.
        generation=GenerationConfig(max_new_tokens=12 if continued else 6, seed=3,
                                    stop_check_interval=2 if partial else 8,
                                    stop_sequences=[[t] for t in range(100, 164)]
                                    if continued else []),
        # GRPO scores by the rule alone, whose groups are often all equal: dynamic sampling
        # drops and refills them, and its refill rounds must resume bit for bit too.
        reward=RewardConfig(model_weight=0.0 if grpo else 0.5, rule="synthetic"),
        ptx=PTXConfig(coef=0.0 if grpo else 0.5),
        checkpoint=CheckpointConfig(**checkpoint), steps=steps, run_dir=f"{root}/{name}")
    config.algorithm.advantage_estimator = "grpo" if grpo else "gae"
    config.algorithm.dynamic_sampling = grpo and not partial
    config.algorithm.max_refill_rounds = 1
    config.algorithm.adaptive_kl = True
    # Off-policy corrections read the trainer's log-probs before each step's update (resumed
    # weights) and generation's (stored with the experience produced ahead).
    config.algorithm.off_policy = "truncated_is" if grpo else "decoupled"
    config.actor_optimizer.lr = config.critic_optimizer.lr = 1e-3
    return config


def _runs(root: str, algorithm: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo

    save_dir = f"{root}/{algorithm}-ckpt"
    run_ppo(_config(root, f"{algorithm}-A", algorithm, steps=4))
    # The same 4 steps, saving after step 2 while the shadows hold step 2's experience.
    run_ppo(_config(root, f"{algorithm}-saving", algorithm, steps=4, save_dir=save_dir,
                    save_interval=2, keep_last=0))
    step_2 = Path(save_dir, "step_00000002")
    stored = sorted(p.name for p in (step_2 / "experience").iterdir())
    run_ppo(_config(root, f"{algorithm}-B", algorithm, steps=4, resume_from=str(step_2)))
    names = ("A", "saving", "B")
    if algorithm != "continued":
        names += ("C",)
        run_ppo(_config(root, f"{algorithm}-C", algorithm, steps=4, resume_from=str(step_2),
                        resume_skip=["experience"]))
    if dist.get_rank() != 0:
        return {}
    answers = step_2 / "answers"
    return {"stored": stored, "answers": sorted(p.name for p in answers.iterdir())
            if answers.is_dir() else [],
            **{name: run_metrics(f"{root}/{algorithm}-{name}") for name in names}}


def _both(root: str) -> dict:
    return {algorithm: _runs(root, algorithm)
            for algorithm in ("ppo", "grpo", "partial", "continued")}


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_asynchronous_runs_resume_bit_exactly_with_the_experience_produced_ahead(
        tmp_path: Path) -> None:
    results = run_on_ranks(_both, world_size=4, args=(str(tmp_path),), timeout_s=540)[0]
    continued = results.pop("continued")
    for algorithm, runs in results.items():
        assert runs["stored"] == ["step_00000002.pt"], algorithm
        assert runs["answers"] == [], algorithm
        assert [m["step"] for m in runs["A"]] == [0, 1, 2, 3]
        assert runs["saving"] == runs["A"], f"{algorithm}: saving changed the run"
        assert all("off_policy/logprob_gap" in m for m in runs["A"]), algorithm
        assert [m["step"] for m in runs["B"]] == [2, 3]
        assert runs["B"] == runs["A"][2:], f"{algorithm}: the resumed run differs"
        assert runs["C"][0] != runs["A"][2], \
            f"{algorithm}: regenerating the stored experience changed nothing"
    assert any(m["dynamic_sampling/rounds"] == 2 for m in results["grpo"]["A"]), \
        "some GRPO step refilled its batch"
    assert any(m["rollout/partial_fraction"] > 0 for m in results["partial"]["A"]), \
        "some answer spans the hand-over"
    # Answers that go on across steps: the save restarts those still decoding (their prompts
    # wait again), so the saving run leaves the uninterrupted one at the save, and its resume
    # continues it bit for bit from the saved finished answers and waiting prompts.
    assert continued["stored"] == ["step_00000002.pt"]
    assert continued["answers"] == ["replica_000.pt", "replica_001.pt"]  # the shadow: dp 2
    assert continued["saving"][:2] == continued["A"][:2]
    assert continued["saving"][2:] != continued["A"][2:], "an answer was in flight at the save"
    assert continued["B"] == continued["saving"][2:], "the resumed run differs"
    assert max(m["rollout/staleness_max"] for m in continued["A"]) >= 2, "answers outlive steps"
