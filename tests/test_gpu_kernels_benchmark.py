"""benchmarks/gpu_kernels.py at tiny shapes on CPU: one JSON line, every figure measured, and the
folded GQA decode attention equal to enable_gqa's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_kernel_benchmark_prints_every_figure_at_tiny_shapes() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_kernels.py", "--tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    decode = figures["decode_attention"]
    assert decode["max_abs_diff"] < 1e-5
    assert decode["enable_gqa_ms"] > 0 and decode["folded_ms"] > 0
    assert figures["packed_attention"]["path"] == "per-sequence loop"  # no CUDA here
    assert figures["sampler_vocab_64"]["float64_cdf_ms"] > 0
    assert not [name for name, value in figures.items()
                if isinstance(value, dict) and "error" in value]
