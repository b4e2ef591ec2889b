"""benchmarks/decode_floor.py: its per-GEMM split of a decode step against ppo_step's FLOP count."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_floor  # noqa: E402
import ppo_step  # noqa: E402


def test_decode_gemms_add_up_to_ppo_steps_count_of_a_decode_step() -> None:
    from megatron_rlhf.topology.models import ArchSpec

    for fields in (ppo_step.SHAPES["default"],
                   {**ppo_step.SHAPES["default"], "num_query_groups": 2, "vocab_size": 300}):
        arch = ArchSpec("b", **fields)
        gemm_flop = sum(2 * m * k * n * times
                        for m, k, n, times in decode_floor.decode_gemms(arch, 3).values())
        assert gemm_flop == ppo_step.forward_flops(arch, 3, context=0)


def test_decode_step_flop_is_the_mean_over_the_decoded_contexts() -> None:
    from megatron_rlhf.topology.models import ArchSpec

    arch = ArchSpec("b", **ppo_step.SHAPES["default"])
    h, layers = 256, 4
    weights = ppo_step.matmul_weights(arch, value_head=False)
    # prompt 5, 3 new tokens: the prefill gives the first, two decode steps at contexts 6 and 7
    by_hand = sum(2 * 2 * weights + 4 * layers * h * c * 2 for c in (6, 7)) / 2
    assert decode_floor.decode_step_flops(arch, batch=2, prompt=5, new_tokens=3) == by_hand
