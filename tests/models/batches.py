"""The token batches the trainer tests step on: the same global batch for every layout."""

from __future__ import annotations

import torch

GLOBAL_BATCH = 8


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """``GLOBAL_BATCH`` rows of 12 tokens with 3-12 real ones, fixed by ``step``."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 250, (GLOBAL_BATCH, 12), generator=generator)
    lengths = torch.randint(3, 13, (GLOBAL_BATCH,), generator=generator)
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}
