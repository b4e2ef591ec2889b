"""Model FLOPs of the training and generation stages, and their utilisation of the devices.

The FLOPs are ``topology.flops``'s, the count the planner's stage times use too: 2 per weight of
every matrix product a real token passes through (attention, the dense MLP or a
mixture-of-experts layer's router, ``topk`` routed experts and shared expert, the LM or value
head; not the embedding lookup) plus causal attention, ``4 * L * q * l^2 / 2`` over a sequence of
``l`` real tokens (``q`` heads x head size); a training pass is 3 forwards, 2 for a model that
trains LoRA adapters on a frozen base (no weight gradients; the adapters' own ``rank``-wide
products are left out, as the planner leaves them out), and recomputation is not model work. Padding is not counted: it is not model work, which is what makes the figure
comparable between the packed and the padded layouts and across systems.

Each rank records, per stage, the FLOPs of its share of the work (a model replica's FLOPs
divided over its TP x PP ranks) and its capacity, seconds x its device's peak; the step's MFU
is the sum of the FLOPs over the sum of the capacities, over every rank (``engine.runner``). The
peak is the spec sheet's dense bf16 rate for a GPU the table knows, else a measured matmul rate
(on CPU the measured fp32 rate).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import cache

import torch
import torch.distributed as dist

from megatron_rlhf.models.lora import has_lora
from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.topology.flops import sequence_flops, training_passes

# Dense bf16 FLOP/s of the GPUs the project has seen (spec sheets).
SPEC_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
STAGES = ("train", "generate")


def work_flops(model: torch.nn.Module, rows: Iterable[tuple[torch.Tensor, int]]) -> float:
    """Model FLOPs of ``rows``, ``(attention_mask, forwards)`` pairs: each mask's rows are whole
    causal sequences of their real tokens, passed through ``model`` in ``forwards`` forward
    equivalents (:func:`training_forwards` to train, 1 forward-only). A scalar head
    counts ``h`` output weights; a policy-value head (``lm+scalar``) its vocabulary projection.
    The architecture is the record the model keeps (``model.arch``, ``models.gpt.build_gpt_model``;
    every layer's MLP an MoE layer when it has experts), the one the planner counts too."""
    value_head = model.head_kind == "scalar"
    return sum(forwards * sequence_flops(model.arch, mask.sum(dim=1).tolist(), value_head)
               for mask, forwards in rows)


def training_forwards(model: torch.nn.Module) -> int:
    """Forward equivalents of a training pass of ``model`` (``topology.flops.training_passes``,
    the planner's count): 2 when it carries LoRA adapters (``models.lora.apply_lora`` froze its
    base), else 3."""
    return training_passes(frozen_base=has_lora(model))


@cache
def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s the device can reach: a known GPU's spec-sheet bf16 peak, else a measured
    ``dtype`` matmul rate (once per process)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = next((peak for key, peak in SPEC_PEAK_FLOPS.items() if key in name), None)
        if known is not None:
            return known
    n = 4096 if device.type == "cuda" else 512
    # A generator of its own: drawing from the default one would shift the dropout masks of the
    # run that happens to measure first, and a resumed run would no longer repeat it.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    a @ b
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


class WorkMeter:
    """This rank's FLOPs and capacity (seconds x peak FLOP/s) per stage since the last take."""

    def __init__(self, peak_flops: float) -> None:
        self.peak_flops = peak_flops
        self._sums: dict[str, float] = {}

    def record(self, stage: str, flops: float, seconds: float) -> None:
        """Add a stage's work done on this rank in ``seconds``."""
        for key, value in ((f"throughput/{stage}_flop", flops),
                           (f"throughput/{stage}_capacity_flop", seconds * self.peak_flops)):
            self._sums[key] = self._sums.get(key, 0.0) + value

    def take(self) -> dict[str, float]:
        """The sums so far, reset."""
        sums, self._sums = self._sums, {}
        return sums


def take_work_sums(engine) -> dict[str, float]:
    """This rank's FLOPs and capacity per stage since the last call (a ``PPOEngine``'s workers
    on one rank share one :class:`WorkMeter`)."""
    meters = {id(w.work): w.work for w in engine.workers.values() if w.work is not None}
    return {key: value for meter in meters.values() for key, value in meter.take().items()}


def utilisation(totals: dict[str, float]) -> dict[str, float]:
    """``throughput/<stage>_mfu`` of every stage with recorded work, from sums over ranks."""
    metrics = {}
    for stage in STAGES:
        capacity = totals.get(f"throughput/{stage}_capacity_flop", 0.0)
        if capacity:
            metrics[f"throughput/{stage}_mfu"] = totals[f"throughput/{stage}_flop"] / capacity
    return metrics


def step_throughput(engine, metrics: dict[str, float], rows: int, seconds: float
                    ) -> dict[str, float]:
    """The step's throughput (collective over the world): ``throughput/tokens_per_s_per_device``,
    its prompt and generated tokens per second per rank of the job (NeMo-RL's definition; absent
    for a step without experience), and the MFU of its training and generation stages
    (``engine.throughput``). Kept out of ``PPOAlgorithm.step``'s metrics, which are results of
    the math and equal between identical runs; these are measurements."""
    sums = take_work_sums(engine)
    keys = [f"throughput/{stage}_{kind}" for stage in STAGES for kind in ("flop",
                                                                         "capacity_flop")]
    totals = torch.tensor([sums.get(key, 0.0) for key in keys], dtype=torch.float64,
                          device=comm_device())
    # World: every rank's models contribute to the stages.
    dist.all_reduce(totals, group=dist.group.WORLD)
    result = utilisation(dict(zip(keys, totals.tolist(), strict=True)))
    if "prompt_length" in metrics:
        tokens = rows * (metrics["prompt_length"] + metrics["response_length"])
        result["throughput/tokens_per_s_per_device"] = tokens / seconds / dist.get_world_size()
    return result
