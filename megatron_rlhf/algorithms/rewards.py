"""Sequence scores to token-level rewards.

The order applied to a batch of reward-model scores is: normalise (``normalize_scores``), clip
(``reward_clip``), then place (``compute_token_level_rewards``): every response token gets
``-kl_coef * kl`` and the last response token of each sequence also gets the score.

Normalisation modes:

- ``none``: scores are used as they are.
- ``batch``: standardise with the mean and population std of this batch (stateless; a batch of one
  score becomes 0).
- ``running``: standardise with a running mean and population std over all scores seen so far,
  this batch included (``RunningMoments``, checkpointed with ``state_dict``).

Normalisation sees whatever batch it is given: to be placement independent the caller normalises
the full experience batch, not a data-parallel shard.
"""

from __future__ import annotations

import math

import torch

SCORE_NORMALIZATIONS = ("none", "batch", "running")


class RunningMoments:
    """Running mean and population variance of scalar scores (Chan et al. parallel merge).

    Kept as Python floats in double precision so the state is device free and checkpointable.
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    @property
    def std(self) -> float:
        """Population standard deviation of everything seen so far."""
        return math.sqrt(self.var)

    def update(self, values: torch.Tensor) -> None:
        """Merges a batch into the running moments.

        Args:
            values: Tensor of any shape; every element is one observation.
        """
        flat = values.detach().to(torch.float64).flatten()
        n = flat.numel()
        if n == 0:
            return
        batch_mean = flat.mean().item()
        batch_var = flat.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> dict[str, float | int]:
        """Returns ``mean``, ``var`` and ``count``, for checkpoints."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restores moments saved by ``state_dict``.

        Args:
            state: A dict with keys ``mean``, ``var`` and ``count``.
        """
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.count = int(state["count"])


def normalize_scores(
    scores: torch.Tensor,
    mode: str,
    running: RunningMoments | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Standardises sequence scores (see the module docstring for the modes).

    Args:
        scores: ``[batch]`` reward-model scores.
        mode: One of ``SCORE_NORMALIZATIONS``.
        running: The running moments, required (and updated in place) when ``mode`` is
            ``running``.
        eps: Added to the variance before the square root.

    Returns:
        ``[batch]`` normalised scores.

    Raises:
        ValueError: If ``mode`` is unknown, or ``running`` is missing for ``mode="running"``.
    """
    if mode == "none":
        return scores
    if mode == "batch":
        mean = scores.mean()
        var = scores.var(unbiased=False)
        return (scores - mean) * torch.rsqrt(var + eps)
    if mode == "running":
        if running is None:
            raise ValueError(
                "normalize_scores(mode='running') needs a RunningMoments; pass running="
            )
        running.update(scores)
        return (scores - running.mean) / math.sqrt(running.var + eps)
    raise ValueError(f"score normalisation {mode!r} is unknown; use one of {SCORE_NORMALIZATIONS}")


def compute_token_level_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    reward_clip: float | None = None,
) -> torch.Tensor:
    """Token rewards: KL penalty on every response token, score on the last one.

    The last response token of a row is the rightmost position where ``response_mask`` is 1. A row
    without any response token receives no score.

    Args:
        scores: ``[batch]`` sequence scores (already normalised if wanted).
        kl: ``[batch, response_len]`` per-token KL estimate (see ``kl_penalty``).
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        kl_coef: Weight of the KL penalty.
        reward_clip: If set, scores are clipped to ``[-reward_clip, reward_clip]``.

    Returns:
        ``[batch, response_len]`` rewards, 0 at padded positions.
    """
    if reward_clip is not None:
        scores = scores.clamp(-reward_clip, reward_clip)
    mask = response_mask.bool()
    rewards = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))
    positions = torch.arange(kl.shape[-1], device=kl.device)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1)
    at_last = positions.unsqueeze(0) == last.unsqueeze(-1)
    return torch.where(at_last, rewards + scores.to(rewards.dtype).unsqueeze(-1), rewards)
