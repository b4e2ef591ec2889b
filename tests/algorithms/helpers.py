"""Random right-padded batches for the PPO math tests, built with numpy."""

from __future__ import annotations

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
