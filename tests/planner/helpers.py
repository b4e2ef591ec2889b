"""A round-number device that makes hand computations easy."""

from __future__ import annotations

from megatron_rlhf.planner import HardwareProfile

ROUND = HardwareProfile(
    name="round", peak_tflops=100.0, hbm_gb_per_s=1000.0, memory_gib=80.0,
    intra_node_gbps=800.0, inter_node_gbps=800.0, host_gb_per_s=10.0,
    compute_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
    layer_latency_s=0.0, call_latency_s=0.0, collective_latency_s=0.0, step_latency_s=0.0,
    usable_memory_fraction=1.0,
)
"""100 TFLOP/s, 1 TB/s HBM, 100 GB/s links, no latencies, every efficiency 1."""
