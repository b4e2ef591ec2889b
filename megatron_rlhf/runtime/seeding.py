"""Deterministic seeding of Python, numpy and torch."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed every host-side RNG the same way on every rank.

    Megatron's model-parallel RNG tracker (dropout streams per TP rank) is seeded separately by
    :func:`megatron_rlhf.runtime.cpu_compat.seed_model_parallel_rng`, because it needs the model's
    TP rank.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
