"""The PPO step's composition checked against a hand computation, with no process group.

Every placement, resume and PTX test runs the same ``engine.experience.compute_advantages`` and
the same loss functions, so they compare the step with itself: a wrong sign, weight or
normalisation in how the step composes the algorithm functions passes all of them. Here the
advantages, returns, KL and step metrics of a small padded batch, and the actor's and critic's
losses and gradients, are written out again from the papers' formulas as plain Python loops over
the real tokens of each row (no call into ``megatron_rlhf.algorithms``), and compared with the
package for every estimator, both KL placements, every score normalisation, reward clipping and
advantage whitening.

Formulas: GAE (Schulman et al., 2016), REINFORCE++ (Hu, 2025), GRPO (Shao et al., 2024), RLOO
(Ahmadian et al., 2024), the KL estimators k1/k2/k3 (Schulman, "Approximating KL divergence",
2020), the adaptive KL controller (Ziegler et al., 2019), the clipped surrogate and clipped value
loss (Schulman et al., 2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import PPOAlgorithmConfig, RunningMoments, build_kl_controller
from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures
from megatron_rlhf.engine.step.experience import compute_advantages
from megatron_rlhf.engine.step.training_losses import actor_loss_fn, critic_loss_fn

LENGTHS = [3, 5, 1, 4, 5, 2]
"""Six right-padded responses: two groups of three for grpo and rloo."""
WIDTH = 5
GROUP = 3
SEEDS = (4, 6)
"""Two batches whose rule scores are mixed (a rule weight shows even under normalisation)."""
RM_WEIGHT, RULE_WEIGHT = 0.7, 1.9
"""Neither is 1, so a weight that is dropped or swapped changes the scores."""
GAMMA, LAM = 0.9, 0.7
"""Different and below 1, so a swapped or dropped discount changes the advantages."""
CLIP = 1.5
"""Bites on some scores of each batch, raw or normalised, and not on others."""
KL_COEF, KL_TARGET, KL_HORIZON = 0.3, 0.5, 8
"""A short horizon moves the adaptive coefficient by a visible amount in one step."""


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Float64 experience fields; ``nan`` on padding, so any leak of it shows."""
    rng = np.random.default_rng(seed)
    rows = len(LENGTHS)

    def padded(loc: float, scale: float) -> torch.Tensor:
        values = np.full((rows, WIDTH), np.nan)
        for row, length in enumerate(LENGTHS):
            values[row, :length] = rng.normal(loc, scale, size=length)
        return torch.from_numpy(values)

    mask = torch.tensor([[1.0 if t < length else 0.0 for t in range(WIDTH)] for length in LENGTHS],
                        dtype=torch.float64)
    old = padded(-2.0, 0.5)
    return {"old_logprobs": old, "ref_logprobs": old + padded(0.2, 0.4),
            "values": padded(0.3, 0.6), "response_mask": mask,
            "rm_scores": torch.from_numpy(rng.normal(0.4, 1.2, size=rows)),
            "rule_scores": torch.from_numpy(rng.integers(0, 2, size=rows).astype(np.float64))}


def _kl(logp: float, ref: float, estimator: str) -> float:
    """Schulman's estimators of KL(policy || ref) from one sample, ``r = p_ref / p``."""
    log_r = ref - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    return math.exp(log_r) - 1.0 - log_r


def _whiten(rows: list[list[float]], shift_mean: bool) -> list[list[float]]:
    """Over every token of the batch: minus the mean, over the unbiased std (+1e-8 in the var)."""
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [[(x - mean) * scale + (0.0 if shift_mean else mean) for x in row] for row in rows]


@dataclass
class _HandState:
    """What the step carries from one batch to the next: the KL coefficient and the scores."""

    kl_coef: float
    seen_scores: list[float] = field(default_factory=list)


def _hand_step(fields: dict[str, torch.Tensor], cfg: PPOAlgorithmConfig,
               state: _HandState) -> dict:
    """Advantages, returns, per-token KL and metrics of one step, row by row."""
    lengths = [int(n) for n in fields["response_mask"].sum(dim=1)]
    real = {key: [fields[key][row, :n].tolist() for row, n in enumerate(lengths)]
            for key in ("old_logprobs", "ref_logprobs", "values")}
    kl = [[_kl(p, q, cfg.kl_estimator) for p, q in zip(ps, qs, strict=True)]
          for ps, qs in zip(real["old_logprobs"], real["ref_logprobs"], strict=True)]
    raw = [RM_WEIGHT * a + RULE_WEIGHT * b
           for a, b in zip(fields["rm_scores"].tolist(), fields["rule_scores"].tolist(),
                           strict=True)]
    scores = list(raw)
    if cfg.reward_norm == "batch":
        mean = sum(raw) / len(raw)
        var = sum((s - mean) ** 2 for s in raw) / len(raw)
        scores = [(s - mean) / math.sqrt(var + 1e-8) for s in raw]
    elif cfg.reward_norm == "running":
        state.seen_scores += raw
        mean = sum(state.seen_scores) / len(state.seen_scores)
        var = sum((s - mean) ** 2 for s in state.seen_scores) / len(state.seen_scores)
        scores = [(s - mean) / math.sqrt(var + 1e-8) for s in raw]
    if cfg.reward_clip is not None:
        scores = [min(max(s, -cfg.reward_clip), cfg.reward_clip) for s in scores]
    # With the KL as a loss term the reward carries none of it, whatever kl_coef says.
    coef = state.kl_coef if cfg.kl_in == "reward" else 0.0
    rewards = [[-coef * k for k in row] for row in kl]
    for row, score in zip(rewards, scores, strict=True):
        row[-1] += score
    sequence_kl = sum(sum(row) for row in kl) / len(kl)
    if cfg.kl_in == "reward" and cfg.adaptive_kl:
        error = min(max(sequence_kl / cfg.kl_target - 1.0, -0.2), 0.2)
        state.kl_coef *= 1.0 + error * len(kl) / cfg.kl_horizon
    advantages, returns = _hand_advantages(rewards, real["values"], cfg)
    tokens = sum(lengths)
    metrics = {
        "reward_mean": sum(raw) / len(raw),
        "rm_score": float(fields["rm_scores"].mean()),
        "rule_score": float(fields["rule_scores"].mean()),
        "kl": sequence_kl,
        "kl_coef": coef,
        "response_length": tokens / len(lengths),
        "response_length_max": float(max(lengths)),
        "returns_mean": sum(x for row in returns for x in row) / tokens,
        "values_mean": sum(x for row in real["values"] for x in row) / tokens,
    }
    return {"advantages": advantages, "returns": returns, "kl": kl, "metrics": metrics}


def _hand_advantages(rewards: list[list[float]], values: list[list[float]],
                     cfg: PPOAlgorithmConfig) -> tuple[list[list[float]], list[list[float]]]:
    if cfg.advantage_estimator == "gae":
        advantages, returns = [], []
        for r, v in zip(rewards, values, strict=True):
            a, next_a = [0.0] * len(r), 0.0
            for t in reversed(range(len(r))):
                next_v = v[t + 1] if t + 1 < len(r) else 0.0
                delta = r[t] + cfg.gamma * next_v - v[t]
                next_a = a[t] = delta + cfg.gamma * cfg.lam * next_a
            advantages.append(a)
            returns.append([x + y for x, y in zip(a, v, strict=True)])
        if cfg.whiten_advantages:
            advantages = _whiten(advantages, cfg.whiten_shift_mean)
        return advantages, returns
    if cfg.advantage_estimator == "reinforce++":
        returns = []
        for r in rewards:
            g, next_g = [0.0] * len(r), 0.0
            for t in reversed(range(len(r))):
                next_g = g[t] = r[t] + cfg.gamma * next_g
            returns.append(g)
        return _whiten(returns, shift_mean=True), returns
    sequence = [sum(r) for r in rewards]
    per_row = []
    for start in range(0, len(sequence), GROUP):
        group = sequence[start:start + GROUP]
        mean = sum(group) / GROUP
        for s in group:
            if cfg.advantage_estimator == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in group) / (GROUP - 1))
                per_row.append((s - mean) / (std + 1e-6) if cfg.grpo_std_normalize else s - mean)
            else:
                per_row.append(s - (sum(group) - s) / (GROUP - 1))
    advantages = [[a] * len(r) for a, r in zip(per_row, rewards, strict=True)]
    return advantages, advantages


def _real(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [tensor[row][mask[row].bool()].tolist() for row in range(tensor.shape[0])]


def _cases() -> list:
    cases = []
    for estimator in ("gae", "grpo", "rloo", "reinforce++"):
        for kl_in in ("reward", "loss"):
            for reward_norm in ("none", "batch", "running"):
                for reward_clip in (None, CLIP):
                    adaptive = kl_in == "reward" and reward_norm != "batch"
                    case = dict(advantage_estimator=estimator, kl_in=kl_in,
                                reward_norm=reward_norm, reward_clip=reward_clip,
                                adaptive_kl=adaptive)
                    cases.append(pytest.param(case, id="-".join(
                        f"{v}" for v in (estimator, kl_in, reward_norm, f"clip{reward_clip}",
                                         "adaptive" if adaptive else "fixed"))))
    variants = [dict(advantage_estimator="gae", whiten_advantages=False),
                dict(advantage_estimator="gae", whiten_shift_mean=False),
                dict(advantage_estimator="gae", gamma=1.0, lam=0.95),
                dict(advantage_estimator="grpo", grpo_std_normalize=False)]
    variants += [dict(advantage_estimator="gae", kl_estimator=k) for k in ("k2", "k3")]
    variants += [dict(advantage_estimator="reinforce++", kl_estimator="k3")]
    cases += [pytest.param(v, id="-".join(f"{k}={x}" for k, x in v.items())) for v in variants]
    return cases


@pytest.mark.parametrize("overrides", _cases())
def test_advantages_returns_kl_and_metrics_match_a_hand_computation(overrides: dict) -> None:
    """Two successive steps, so the adaptive KL coefficient and the running score moments carry
    over from the first batch into the second."""
    settings = dict(gamma=GAMMA, lam=LAM, kl_coef=KL_COEF, kl_target=KL_TARGET,
                    kl_horizon=KL_HORIZON, kl_estimator="k1")
    cfg = PPOAlgorithmConfig(**{**settings, **overrides})
    controller, moments = build_kl_controller(cfg), RunningMoments()
    state = _HandState(kl_coef=cfg.kl_coef)
    for seed in SEEDS:
        fields = _batch(seed)
        if not cfg.uses_critic:
            del fields["values"]
        got, metrics = compute_advantages(fields, cfg, controller, moments, RM_WEIGHT,
                                          RULE_WEIGHT, samples_per_prompt=GROUP,
                                          features=ExperienceFeatures(
                                              critic=cfg.uses_critic, reward_model=True))
        want = _hand_step(_batch(seed), cfg, state)
        mask = fields["response_mask"]
        for key in ("advantages", "returns", "kl"):
            got_rows = _real(got[key], mask)
            assert sum(len(r) for r in got_rows) == sum(LENGTHS)
            np.testing.assert_allclose(np.concatenate(got_rows), np.concatenate(want[key]),
                                       rtol=1e-9, atol=1e-9, err_msg=f"{key}, batch {seed}")
            padding = got[key][~mask.bool()]
            assert torch.equal(padding, torch.zeros_like(padding)), f"{key} padding, {seed}"
        expected = dict(want["metrics"])
        if not cfg.uses_critic:
            del expected["values_mean"]
        assert metrics.keys() == expected.keys()
        for key, value in expected.items():
            # The package counts response tokens in float32.
            rel = 1e-6 if key == "response_length" else 1e-9
            assert metrics[key] == pytest.approx(value, rel=rel, abs=1e-12), f"{key}, {seed}"
    expected_coef = state.kl_coef if cfg.kl_in == "reward" else 0.0
    assert controller.value == pytest.approx(expected_coef, rel=1e-12)


def test_the_cases_move_the_adaptive_coefficient_and_clip_some_scores() -> None:
    """Guards the test data: a coefficient that never moves or a clip that never bites would let
    a wrong update or a missing clip pass the hand comparison."""
    state = _HandState(kl_coef=KL_COEF)
    cfg = PPOAlgorithmConfig(kl_coef=KL_COEF, kl_target=KL_TARGET, kl_horizon=KL_HORIZON,
                             adaptive_kl=True)
    _hand_step(_batch(SEEDS[0]), cfg, state)
    assert abs(state.kl_coef / KL_COEF - 1.0) > 0.05
    for seed in SEEDS:
        fields = _batch(seed)
        raw = RM_WEIGHT * fields["rm_scores"] + RULE_WEIGHT * fields["rule_scores"]
        normalised = (raw - raw.mean()) / raw.std(unbiased=False)
        for scores in (raw, normalised):
            assert (scores.abs() > CLIP).any() and (scores.abs() < CLIP).any()
        assert 0 < fields["rule_scores"].sum() < len(LENGTHS)


class _FakeWorker:
    """The two methods the loss functions read from a model's output, for an output laid out
    ``[batch, response_len, 3]`` as (log-prob, entropy, value) of each response token."""

    def __init__(self, head: str) -> None:
        self.head = head
        self.pg_collection = SimpleNamespace(tp=None)

    def token_logprobs(self, output, batch, prompt_len, temperature, with_entropy=False):
        return output[..., 0], output[..., 1] if with_entropy else None

    def token_values(self, output, prompt_len):
        return output[..., 2]


def _loss_inputs(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A model output with grad and the experience batch it is trained on; the new values sit
    both inside and outside the value clip range around the old ones."""
    fields = _batch(seed)
    mask = fields["response_mask"]
    rng = np.random.default_rng(seed + 100)
    noise = torch.from_numpy(rng.normal(0.0, 0.3, size=mask.shape))
    logprobs = fields["old_logprobs"] + noise
    entropy = torch.from_numpy(rng.uniform(0.5, 2.0, size=mask.shape))
    values = fields["values"] + torch.from_numpy(rng.normal(0.0, 0.4, size=mask.shape))
    output = torch.stack([logprobs, entropy, values], dim=-1).nan_to_num(0.0)
    advantages = torch.from_numpy(rng.normal(0.0, 1.0, size=mask.shape))
    returns = fields["values"] + torch.from_numpy(rng.normal(0.0, 0.5, size=mask.shape))
    batch = {**fields, "advantages": advantages, "returns": returns}
    return output.requires_grad_(True), batch


def _hand_actor_loss(output: torch.Tensor, batch: dict, cfg: PPOAlgorithmConfig, head: str):
    """The actor's loss token by token: surrogate, KL to the reference, entropy, values."""
    lengths = [int(n) for n in batch["response_mask"].sum(dim=1)]
    terms = {"pg": [], "kl": [], "entropy": [], "vf": []}
    for row, n in enumerate(lengths):
        for key in terms:
            terms[key].append([])
        for t in range(n):
            logp, entropy, value = output[row, t, 0], output[row, t, 1], output[row, t, 2]
            old = float(batch["old_logprobs"][row, t])
            advantage = float(batch["advantages"][row, t])
            ratio = torch.exp(logp - old)
            clipped = torch.clamp(ratio, 1.0 - cfg.clip_ratio, 1.0 + cfg.clip_ratio)
            terms["pg"][-1].append(-torch.minimum(ratio * advantage, clipped * advantage))
            log_r = float(batch["ref_logprobs"][row, t]) - logp
            terms["kl"][-1].append(torch.exp(log_r) - 1.0 - log_r)
            terms["entropy"][-1].append(entropy)
            terms["vf"][-1].append(_hand_value_term(value, batch, row, t, cfg.value_clip))

    def token_mean(rows):
        return sum(x for r in rows for x in r) / sum(lengths)

    def aggregate(rows):
        if cfg.loss_aggregation == "token_mean":
            return token_mean(rows)
        if cfg.loss_aggregation == "seq_mean_token_mean":
            return sum(sum(r) / len(r) for r in rows) / len(rows)
        return sum(sum(r) for r in rows) / len(rows)

    loss = aggregate(terms["pg"]) - cfg.entropy_coef * token_mean(terms["entropy"])
    if cfg.kl_in == "loss":
        loss = loss + cfg.kl_loss_coef * aggregate(terms["kl"])
    if head == "lm+scalar":
        loss = loss + cfg.value_loss_coef * token_mean(terms["vf"])
    return loss


def _hand_value_term(value: torch.Tensor, batch: dict, row: int, t: int,
                     value_clip: float | None) -> torch.Tensor:
    """``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` of one token."""
    old = float(batch["values"][row, t])
    target = float(batch["returns"][row, t])
    unclipped = (value - target) ** 2
    if value_clip is None:
        return 0.5 * unclipped
    clipped = (old + torch.clamp(value - old, -value_clip, value_clip) - target) ** 2
    return 0.5 * torch.maximum(unclipped, clipped)


def _loss_and_gradient(loss_fn, output: torch.Tensor, batch: dict):
    """The loss megatron's schedule would see (sum over count) and its gradient."""
    scaled, count, _ = loss_fn(output, batch)
    loss = scaled / count
    return loss, torch.autograd.grad(loss, output)[0]


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(kl_in="loss"),
    dict(kl_in="loss", kl_loss_coef=0.4, loss_aggregation="seq_mean_token_mean"),
    dict(kl_in="loss", kl_loss_coef=0.4, loss_aggregation="seq_mean_token_sum"),
    dict(entropy_coef=0.05, clip_ratio=0.1),
    dict(head="lm+scalar", value_loss_coef=0.5),
    dict(head="lm+scalar", value_clip=None, kl_in="loss", kl_loss_coef=0.2),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_actor_loss_and_gradient_match_the_formula(overrides: dict) -> None:
    overrides = dict(overrides)
    head = overrides.pop("head", "lm")
    cfg = PPOAlgorithmConfig(**overrides)
    output, batch = _loss_inputs(3)
    loss, gradient = _loss_and_gradient(actor_loss_fn(_FakeWorker(head), 0, 1.0, cfg),
                                        output, batch)
    want = _hand_actor_loss(output, batch, cfg, head)
    want_gradient = torch.autograd.grad(want, output)[0]
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-10)
    torch.testing.assert_close(gradient, want_gradient, rtol=1e-9, atol=1e-12)
    assert gradient[..., 0].abs().sum() > 0


@pytest.mark.parametrize("value_clip", [0.2, 0.05, None])
def test_critic_value_loss_and_gradient_match_the_formula(value_clip: float | None) -> None:
    cfg = PPOAlgorithmConfig(value_clip=value_clip)
    output, batch = _loss_inputs(4)
    loss, gradient = _loss_and_gradient(critic_loss_fn(_FakeWorker("scalar"), 0, cfg),
                                        output, batch)
    lengths = [int(n) for n in batch["response_mask"].sum(dim=1)]
    terms = [_hand_value_term(output[row, t, 2], batch, row, t, value_clip)
             for row, n in enumerate(lengths) for t in range(n)]
    want = sum(terms) / len(terms)
    want_gradient = torch.autograd.grad(want, output)[0]
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-10)
    torch.testing.assert_close(gradient, want_gradient, rtol=1e-9, atol=1e-12)
    if value_clip is not None:
        moved = (output[..., 2] - batch["values"]).abs()[batch["response_mask"].bool()]
        assert (moved > value_clip).any() and (moved < value_clip).any(), "both clip branches"


def test_rollout_agreement_reads_only_response_tokens() -> None:
    from megatron_rlhf.engine.step.experience import rollout_agreement

    gen = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 9.0]])
    old = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the last column is padding: never read
    metrics = rollout_agreement(gen, old, mask)
    assert metrics["rollout/logprob_diff_max"] == 0.5
    assert metrics["rollout/logprob_diff_mean"] == (0.5 + 0 + 0 + 0.25) / 4
