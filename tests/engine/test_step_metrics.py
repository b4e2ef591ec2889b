"""A step's metrics from two simulated ranks: the logged names, and values equal to the direct
computation over every micro-batch and update; the model a metric comes from, as a NaN report
names it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.engine.step.step_metrics import (
    accumulate_train_metrics,
    experience_sources,
    nonfinite_report,
    share_metrics,
)
from megatron_rlhf.runtime.metric_reduce import Mean


class _Exchange:
    """Hands every rank's contribution back, as the job's store does."""

    def __init__(self, gathered: list) -> None:
        self.gathered = gathered

    def all_gather_object(self, mine):
        return self.gathered


def _worker(output: bool = True, tp_rank: int = 0) -> SimpleNamespace:
    tp = SimpleNamespace(rank=lambda: tp_rank)
    return SimpleNamespace(is_output_stage=output, pg_collection=SimpleNamespace(tp=tp))


def _update(tokens: list[int], losses: list[float], grad_norm: float, lr: float) -> dict:
    """A trainer's result: per micro-batch a token-weighted ``pg_loss`` and a ptx NLL."""
    micro = [{"pg_loss": Mean(torch.tensor(loss * count), torch.tensor(count)),
              "ppo_kl": Mean(torch.tensor(0.1 * count), torch.tensor(count))}
             for count, loss in zip(tokens, losses, strict=True)]
    micro.append({"ptx_nll": Mean(torch.tensor(6.0), torch.tensor(3))})
    return {"metrics": micro, "grad_norm": grad_norm, "lr": lr, "moe": {"moe_load_max": 2.0}}


def test_two_ranks_combine_into_the_logged_names_and_means() -> None:
    ranks = []
    for rank, (tokens, losses, norm) in enumerate([([2, 3], [1.0, 2.0], 4.0),
                                                    ([5], [3.0], 6.0)]):
        training = {}
        accumulate_train_metrics(training, "actor", _update(tokens, losses, norm, 1e-3),
                                 _worker())
        accumulate_train_metrics(training, "actor", _update([9], [9.0], 9.0, 1e-3),
                                 _worker(tp_rank=1))  # counted on TP rank 0 only
        training["reward/graded/length"] = Mean(10.0 * (rank + 1), 2.0)
        ranks.append(({"reward_mean": 0.5}, training, {"train": 100 * (rank + 1)}))
    metrics = share_metrics({}, {}, exchange=_Exchange(ranks))
    assert metrics == pytest.approx({
        "reward_mean": 0.5, "memory/train_peak_bytes": 200.0,
        "actor/pg_loss": (2 * 1 + 3 * 2 + 5 * 3) / 10, "actor/ppo_kl": 0.1,
        "actor/ptx_nll": 2.0, "actor/grad_norm": 5.0, "actor/lr": 1e-3,
        "actor/moe_load_max": 2.0, "reward/graded/length": 30.0 / 4,
        "policy_loss": 2.3, "value_loss": 0.0})


def test_a_name_given_two_reductions_across_ranks_is_refused() -> None:
    ranks = [({"actor/pg_loss": 1.0}, {}, {}),
             ({}, {"actor/pg_loss": Mean(1.0, 1.0)}, {})]
    with pytest.raises(TypeError, match="'actor/pg_loss' is reduced as Replicated"):
        share_metrics({}, {}, exchange=_Exchange(ranks))


def _engine(reference_is_base: bool) -> SimpleNamespace:
    """What ``experience_sources`` reads of a ``PPOEngine``: a critic-free run scored by rule,
    under separation (the shadow actor generates), its reference log-probs from the reference
    model or, with LoRA on the actor, from the actor's base (``PPOEngine.reference``)."""
    return SimpleNamespace(policy_for_inference="shadow_actor", critic_for_inference=None,
                           scorer="actor", reference_is_base=reference_is_base,
                           reference="actor" if reference_is_base else "ref")


def test_the_reference_log_probs_come_from_the_actors_base_under_lora() -> None:
    sources = experience_sources(_engine(reference_is_base=False))
    assert (sources["ref_logprobs"], sources["kl"]) == ("ref", "shadow_actor and ref")
    sources = experience_sources(_engine(reference_is_base=True))
    assert sources["ref_logprobs"] == "actor (adapters off)"
    assert sources["kl"] == "shadow_actor and actor (adapters off)"
    assert nonfinite_report({"nonfinite/ref_logprobs": 3.0, "kl": float("nan")}, sources) == [
        "3 NaN/Inf values in ref_logprobs (model 'actor (adapters off)', stage 'experience')"]
    assert nonfinite_report({"kl": float("nan")}, sources) == [
        "kl=nan (model 'shadow_actor and actor (adapters off)', stage 'experience')"]
