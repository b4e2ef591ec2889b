"""Shared pytest set-up: one thread per test process on these 2-core machines."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
