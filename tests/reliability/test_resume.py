"""Checkpoint and resume of whole PPO runs on 4 gloo ranks (separation: trainers on ranks 0-1,
shadows, ref and reward on ranks 2-3).

Job 1 runs 2 steps saving after each, and every rank is SIGKILLed while writing the second
checkpoint. Job 2, in one set of processes:

* runs the same 2 steps uninterrupted (A), then resumes job 1's save dir (the unfinished second
  save is skipped; step_1 is used) for the last step: metrics and weights equal A's bit for bit;
* resumes again leaving out one piece of state at a time (optimizer, scheduler, KL controller,
  data position, RNG): each breaks the equality, so the test above can fail;
* right after a resume, the shadow actor's log-probs equal the trained actor's (not the
  reference's): the shadows were re-synced;
* resumes a separation TP1 checkpoint under flattening at TP2 (resharding on load; the critic
  with megatron's plain, non-distributed optimizer): the next step's metrics match the
  uninterrupted run within floating-point tolerance;
* NaN rewards are skipped (faults.on_nan=skip) without moving the KL controller; a NaN actor loss
  with faults.on_nan=stop stops every rank with an error naming the actor and 'training', with the
  weights untouched;
* a rank with another rollout.ppo_epochs (different micro-batch counts) is refused on every rank
  with an error naming the rank and the setting.

The runs use dropout 0.1 (models.dropout) so that the RNG streams matter, an adaptive KL controller, running score normalisation and a linear LR
warm-up, so that each piece of state changes the numbers, and PPO-ptx (whose demonstrations of
each update must be the same after a resume).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.metrics import assert_metrics_match, run_metrics
from tests.helpers.runs import (
    capture_engine,
    run_killed_while_saving_step_2,
    separation_config,
    trained_weights,
)
from tests.multirank import run_on_ranks

STEPS = 2
PIECES = ("optimizer", "scheduler", "kl_controller", "data_position", "rng")


def _config(root: str, name: str, **checkpoint):
    from megatron_rlhf.config.ppo_run import PTXConfig

    config = separation_config(root, name, STEPS, _DROPOUT[0], checkpoint,
                               ptx=PTXConfig(coef=0.5))
    config.algorithm.adaptive_kl = True
    config.algorithm.kl_target = 0.01
    config.algorithm.kl_horizon = 16
    config.algorithm.reward_norm = "running"
    for settings in (config.actor_optimizer, config.critic_optimizer):
        settings.lr = 1e-3
        settings.lr_schedule = "linear"
        settings.lr_warmup_steps = 3
    return config


_DROPOUT = [0.0]


def _patch(dropout: float) -> dict:
    """Dropout of the runs that follow, and the engine of the last run kept in the returned dict."""
    _DROPOUT[0] = dropout
    return capture_engine()


def _killed_run(root: str) -> None:
    import os
    import signal

    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.runtime import checkpoint_store

    _patch(dropout=0.1)
    original = checkpoint_store.hash_files

    def die_while_saving_step_2(temp: Path, names: list[str]):
        if "step_00000002" in str(temp):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(temp, names)

    checkpoint_store.hash_files = die_while_saving_step_2
    run_ppo(_config(root, "killed", save_dir=f"{root}/ckpt", save_interval=1))


def _same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resume_checks(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo

    captured = _patch(dropout=0.1)
    rank0 = dist.get_rank() == 0
    out: dict = {}
    run_ppo(_config(root, "A"))
    weights_a, metrics_a = trained_weights(captured["engine"]), run_metrics(f"{root}/A")
    run_ppo(_config(root, "killed", save_dir=f"{root}/ckpt", resume=True))
    out["resumed_weights_equal"] = _same_weights(trained_weights(captured["engine"]), weights_a)
    if rank0:
        out["resumed_metrics_equal"] = run_metrics(f"{root}/killed") == metrics_a
        out["metrics_steps"] = [m["step"] for m in run_metrics(f"{root}/killed")]
        out["ptx_nll"] = [m.get("actor/ptx_nll") for m in metrics_a]
    step_1 = f"{root}/ckpt/step_00000001"
    for piece in PIECES:
        run_ppo(_config(root, f"drop-{piece}", resume_from=step_1, resume_skip=[piece]))
        same = _same_weights(trained_weights(captured["engine"]), weights_a)
        if rank0:
            same = same and run_metrics(f"{root}/drop-{piece}")[-1] == metrics_a[-1]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, same)
        out[f"equal_without_{piece}"] = all(gathered)
    config = _config(root, "shadows", resume_from=step_1)
    config.steps = 1
    run_ppo(config)
    out["shadow_check"] = _shadow_logprobs_check(captured["engine"], config)
    out.update(_placement_change(root))
    out.update(_nan_checks(root))
    out.update(_disagreement(root))
    return out


def _shadow_logprobs_check(engine, config) -> dict | None:
    """Old log-probs (from the shadow) vs the trained actor's and the reference's, on ranks 0-1."""

    prompts = [[5, 17, 30, 4], [8, 9, 10, 11, 12]] * 4
    rollout = engine.generate_rollout(prompts, list(range(8)))
    experience = engine.make_experience(rollout, config.generation.temperature)
    engine.finish_transfers()
    if "actor" not in engine.workers:
        return None
    fields = experience.fields
    mask = fields["response_mask"].bool()
    actor = engine.workers["actor"].compute_log_prob(fields, config.rollout.max_prompt_length,
                                                     config.generation.temperature)
    return {"max_diff_actor": (actor - fields["old_logprobs"])[mask].abs().max().item(),
            "max_diff_ref": (fields["ref_logprobs"] - fields["old_logprobs"])[mask]
            .abs().max().item(),
            "tokens": int(mask.sum())}


def _placement_change(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo

    _patch(dropout=0.0)
    config = _config(root, "B", save_dir=f"{root}/ckpt-B", save_interval=1)
    config.critic_optimizer.distributed_optimizer = False  # megatron's plain optimizer path
    run_ppo(config)
    config = _config(root, "B-tp2", resume_from=f"{root}/ckpt-B/step_00000001")
    config.critic_optimizer.distributed_optimizer = False
    config.placement.strategy, config.placement.tp = "flattening", 2
    run_ppo(config)
    if dist.get_rank() != 0:
        return {}
    return {"placement_metrics": (run_metrics(f"{root}/B")[-1], run_metrics(f"{root}/B-tp2")[-1])}


def _nan_checks(root: str) -> dict:
    import torch

    from megatron_rlhf.engine.execution.workers import ModelWorker
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.engine.step import ppo
    from megatron_rlhf.runtime.faults import NonFiniteError

    captured = _patch(dropout=0.0)
    scores, calls = ModelWorker.compute_scores, []

    def nan_scores_once(self, fields):
        result = scores(self, fields)
        calls.append(1)
        return result * math.nan if result is not None and len(calls) == 1 else result

    ModelWorker.compute_scores = nan_scores_once
    config = _config(root, "nan-skip")
    config.faults.on_nan = "skip"
    run_ppo(config)
    ModelWorker.compute_scores = scores
    out = {"nan_skip_metrics": run_metrics(f"{root}/nan-skip") if torch.distributed.get_rank() == 0
           else None}

    loss_fn = ppo.actor_loss_fn

    def nan_actor_loss(*args, **kwargs):
        inner = loss_fn(*args, **kwargs)
        return lambda output, batch: (lambda r: (r[0] * math.nan, *r[1:]))(inner(output, batch))

    ppo.actor_loss_fn = nan_actor_loss
    try:
        run_ppo(_config(root, "nan-stop"))
        out["nan_stop"] = "no error"
    except NonFiniteError as error:
        out["nan_stop"] = str(error)
    ppo.actor_loss_fn = loss_fn
    weights = trained_weights(captured["engine"])
    out["weights_finite_after_stop"] = all(bool(torch.isfinite(w).all()) for w in weights.values()
                                           if w.is_floating_point())
    return out


def _disagreement(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.runtime.faults import RankFailure

    config = _config(root, "disagree")
    if dist.get_rank() == 1:
        config.rollout.ppo_epochs = 2
    try:
        run_ppo(config)
    except RankFailure as error:
        return {"disagreement": str(error)}
    return {"disagreement": "no error"}


@pytest.mark.multirank
@pytest.mark.timeout(720)
def test_resume_is_bit_exact_needs_every_piece_and_survives_faults(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_killed_while_saving_step_2(_killed_run, 4, tmp_path, timeout_s=240)

    results = run_on_ranks(_resume_checks, world_size=4, args=(root,), timeout_s=420)
    first = results[0]
    assert first["metrics_steps"] == [0, 1]
    assert all(nll and nll > 0 for nll in first["ptx_nll"]), "every step trained on demonstrations"
    assert first["resumed_metrics_equal"], "resumed metrics differ from the uninterrupted run"
    assert all(r["resumed_weights_equal"] for r in results), "resumed weights differ"
    for piece in PIECES:
        assert not first[f"equal_without_{piece}"], f"leaving out {piece} changed nothing"

    for rank in (0, 1):
        check = results[rank]["shadow_check"]
        assert check["tokens"] > 0
        assert check["max_diff_actor"] < 1e-5, check
        assert check["max_diff_ref"] > 1e-3, check

    uninterrupted, resharded = first["placement_metrics"]
    assert_metrics_match(resharded, uninterrupted, ("reward_mean", "kl", "kl_coef", "policy_loss",
                                                    "value_loss", "actor/grad_norm"), "resharded")

    skipped, normal = first["nan_skip_metrics"]
    assert skipped["skipped"] == 1.0 and skipped["nonfinite/rm_scores"] == 8.0
    assert "skipped" not in normal and math.isfinite(normal["policy_loss"])
    assert normal["kl_coef"] == skipped["kl_coef"], "the KL controller learnt from NaN rewards"
    for r in results:
        assert "non-finite gradients (model 'actor', stage 'training')" in r["nan_stop"], r
        assert r["weights_finite_after_stop"]
        assert "ranks [1]: stage #1 'setup'" in r["disagreement"], r["disagreement"]
        assert "rollout.ppo_epochs=2" in r["disagreement"]
