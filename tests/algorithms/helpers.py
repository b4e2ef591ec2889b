"""Random right-padded batches for the PPO math tests, built with numpy."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

# Response lengths with padding, length-1 responses and one full-width row.
LENGTHS = [1, 5, 3, 7, 1, 6]
WIDTH = 7


def response_mask(lengths: list[int], width: int = WIDTH) -> torch.Tensor:
    """``[batch, width]`` float mask with ``lengths[i]`` leading ones in row ``i``."""
    mask = np.zeros((len(lengths), width))
    for row, length in enumerate(lengths):
        mask[row, :length] = 1.0
    return torch.from_numpy(mask)


def random_padded(
    rng: np.random.Generator,
    lengths: list[int],
    width: int = WIDTH,
    scale: float = 1.0,
    loc: float = 0.0,
    pad: float = float("nan"),
) -> torch.Tensor:
    """``[batch, width]`` float64 normal values; positions past each length hold ``pad``.

    The default ``nan`` padding makes any leak of padding into a result visible.
    """
    values = np.full((len(lengths), width), pad)
    for row, length in enumerate(lengths):
        values[row, :length] = rng.normal(loc, scale, size=length)
    return torch.from_numpy(values)


def real_tokens(tensor: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """The real (unpadded) tokens of each row, as Python floats."""
    return [tensor[row, :length].tolist() for row, length in enumerate(lengths)]


class _LogProbWorker:
    """What ``actor_loss_fn`` reads from a worker, for an output that is the log-probs
    ``[batch, response_len]`` themselves."""

    head = "lm"
    pg_collection = SimpleNamespace(tp=None)

    def token_logprobs(self, output, batch, prompt_len, temperature, with_entropy=False):
        return output, None


def logprob_loss_fn(config):
    """The actor's loss function (``actor_loss_fn``) on log-probs given as the model output."""
    from megatron_rlhf.engine.step.training_losses import actor_loss_fn

    return actor_loss_fn(_LogProbWorker(), 0, 1.0, config)


def actor_loss(config, log_prob: torch.Tensor, batch: dict) -> torch.Tensor:
    """The loss megatron's schedule sees: the summed micro-batch loss over its count."""
    scaled, count, _ = logprob_loss_fn(config)(log_prob, batch)
    return scaled / count
