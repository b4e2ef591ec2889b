"""One PPO step against the machine's matmul roofline, stage by stage, through ``tools/run_ppo.py``.

    python benchmarks/ppo_step.py                         # the reference shape, world sizes 1 and 2
    python benchmarks/ppo_step.py --shape large           # hidden 1024, 8 layers
    python benchmarks/ppo_step.py --world-sizes 2 --placements flattening separation
    python benchmarks/ppo_step.py --world-sizes 1 --layouts padded packed   # packing's gain

Each configuration is a real run: ``torchrun --standalone --nproc-per-node N tools/run_ppo.py``
with the architecture written out in the config (``models.arch`` as a mapping), ``trace=true``,
the shipped task's prompts (6-15 tokens) with ``rollout.max_prompt_length`` = ``--prompt-length``,
every response exactly ``--response-length`` tokens long (``generation.stop_at_eos=false``), fp32,
one PPO epoch and one mini-batch, each layout of ``--layouts`` (``packed``, the default of every
run, or ``padded``: ``models.packed_sequences=false``) in turn. The per-stage seconds come from the run's own timeline
(``timeline.json``), averaged over the steps after the first (warm-up) and, for each stage, over
the ranks that ran it; the step time is the median ``step_seconds`` of those steps.

In the same process, before the runs, it measures the machine's fp32 matmul rate: at a large
square shape (``--square``; the roofline) with every core, and at the step's own GEMM shapes (the
training projections and one decode step's), which bounds what a stage can reach.

Model FLOP per step, counted as executed (padding included, causal attention as the full square
over the context):
    forward(tokens, context, heads=tokens) = tokens * (2 * N_layers + 4 * L * q * context)
                                             + heads * 2 * N_head
    N_layers = L * (h * (q + 2 * kv) + q * h + N_mlp),  N_head = h * V (h for a scalar head)
    generation   = sum over the generation micro-batches the run recorded, each of b rows padded
                   to its own longest prompt Pw, n model calls (n = R when no row stops early):
                   forward(b * Pw, Pw, heads=b) + sum_{t=1}^{n-1} forward(b, Pw + t);
                   under continuous batching each prefill is such a record with n = 1, and the
                   n decode steps over b slots of C cache positions count n * forward(b, C)
    experience   = forward(B * S, S) for each of actor, ref (LM head) and critic, reward (scalar)
    training     = 3 * forward(B * S, S) for actor and critic
with B prompts, P = --prompt-length and R = --response-length, S = P + R, L layers, h hidden size,
q the width of the queries (heads x head size), kv that of the keys (query groups x head size),
N_mlp the MLP's weights a token passes through (m h ffn, m = 3 for SwiGLU and 2 otherwise; of a
mixture-of-experts layer the router, its top-k experts and the shared expert), V the padded
vocabulary: N_layers and N_head count the weights of every matrix product (not the embedding
lookup, norms or biases). N_layers is ``megatron_rlhf.topology.flops``'s count, which the planner
and the MFU metric use; the output layer counts the padded vocabulary it executes. Generation is counted from what ran, not from P: ``generate_sequences``
pads each micro-batch only to its longest prompt, its prefill's logits (taken at the last
position only, megatron's static inference context) give the first token, and each of the other
n - 1 calls feeds one token at context Pw + t; the engine writes every micro-batch's (b, Pw, n)
into the ``work`` of its ``generate`` span in the timeline (one TP rank of each replica counted;
without the KV cache each call is forward(b * (Pw + t), Pw + t), t < n). The experience and
training passes run at the fixed width S (the engine re-pads the rollout to P + R), so they are
counted from the configuration, padding included: under ``packed`` they run the real tokens only
(``padded_token_share`` of the line says how much that drops), so their roofline is a lower
bound there; compare the layouts by their seconds. Achieved FLOP/s of a stage = its FLOP / its seconds; "roofline" =
that / the large-square rate (one line per configuration, JSON, which also gives the smallest and
largest recorded Pw and the number of generation micro-batches counted, over the measured steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_rlhf.topology import flops  # noqa: E402
from megatron_rlhf.topology.models import ArchSpec  # noqa: E402

SHAPES = {
    "default": dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=688,
                    vocab_size=512, seq_length=128, gated_mlp=True),
    "large": dict(num_layers=8, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=2816,
                  vocab_size=512, seq_length=128, gated_mlp=True),
}
EXPERIENCE_ROLES = {"actor": False, "ref": False, "critic": True, "reward": True,
                    "shadow_actor": False, "shadow_critic": True}
"""Role -> whether its output layer is a scalar value head."""


def matmul_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """Sustained fp32 FLOP/s of ``[m, k] @ [k, n]`` on this process's threads."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - start)


def layer_weights(arch: ArchSpec) -> int:
    """``N_layers`` of the module docstring: ``topology.flops``'s count of every layer's matrix
    products, which the planner and the MFU metric use."""
    return arch.num_layers * (flops.attention_weights(arch) + arch.mlp_params(active=True))


def head_weights(arch: ArchSpec, value_head: bool) -> int:
    """``N_head`` of the module docstring: the output layer as executed, over the padded
    vocabulary."""
    return arch.hidden_size * (1 if value_head else arch.padded_vocab_size(1))


def matmul_weights(arch: ArchSpec, value_head: bool) -> int:
    """``N_layers + N_head`` of the module docstring."""
    return layer_weights(arch) + head_weights(arch, value_head)


def forward_flops(arch: ArchSpec, tokens: int, context: int, value_head: bool = False,
                  heads: int | None = None) -> int:
    """``forward(tokens, context, heads)`` of the module docstring (``heads`` = ``tokens`` when
    None)."""
    attention = 4 * arch.num_layers * arch.query_width * context
    heads = tokens if heads is None else heads
    return (tokens * (2 * layer_weights(arch) + attention)
            + heads * 2 * head_weights(arch, value_head))


def generation_flops(arch: ArchSpec, micro_batches: Iterable[Mapping[str, Any]]) -> int:
    """Model FLOP of the generation micro-batches that ran (module docstring).

    Args:
        arch: the generating model's architecture (LM head).
        micro_batches: ``generation.MicroBatchWork`` records as dicts (``rows``,
            ``prompt_width``, ``forwards``, ``kv_cache``, ``decode_context``), as the timeline
            holds them.
    """
    total = 0
    for work in micro_batches:
        b, width, calls = work["rows"], work["prompt_width"], work["forwards"]
        if work.get("decode_context", 0):  # continuous batching's fixed-shape decode steps
            total += calls * forward_flops(arch, b, work["decode_context"])
        elif not work["kv_cache"]:
            total += sum(forward_flops(arch, b * (width + t), width + t) for t in range(calls))
        elif calls > 0:
            total += forward_flops(arch, b * width, width, heads=b) + sum(
                forward_flops(arch, b, width + t) for t in range(1, calls))
    return total


def step_flops(arch: ArchSpec, batch: int, prompt: int, response: int) -> dict[str, float]:
    """Model FLOP of the experience and training passes of one step, which run at the fixed
    width ``prompt + response`` (module docstring); generation's comes from
    :func:`generation_flops`."""
    seq = prompt + response
    flops = {}
    for role, value_head in EXPERIENCE_ROLES.items():
        if not role.startswith("shadow"):
            flops[f"experience/{role}"] = forward_flops(arch, batch * seq, seq, value_head)
    for role in ("actor", "critic"):
        flops[f"train/{role}"] = 3 * forward_flops(arch, batch * seq, seq, role == "critic")
    return flops


def generation_work(timeline: dict, first_step_end: float) -> list[dict]:
    """The generation micro-batches recorded on the ``generate`` spans after ``first_step_end``,
    one TP rank of each replica.

    Raises:
        ValueError: a ``generate`` span without its ``work`` (a run from before it was recorded).
    """
    micro_batches = []
    for event in timeline["traceEvents"]:
        if event.get("ph") != "X" or event["cat"] != "generate" or event["ts"] < first_step_end:
            continue
        work = event["args"].get("work")
        if work is None:
            raise ValueError(f"the generate span of rank {event['pid']} at {event['ts']} us has "
                             "no work record; rerun with this commit's engine")
        if work["tp_rank"] == 0:
            micro_batches += work["micro_batches"]
    return micro_batches


def stage_seconds(timeline: dict, first_step_end: float) -> dict[str, float]:
    """Seconds per stage key (``generate``, ``experience/<model>``, ``train/<model>``,
    ``transfer``, ``sync_weights``) summed per rank after ``first_step_end``, averaged over the
    ranks that ran it."""
    per_rank: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for event in timeline["traceEvents"]:
        if event.get("ph") != "X" or event["ts"] < first_step_end:
            continue
        stage, model = event["cat"], event["args"]["model"]
        key = stage if stage in ("generate", "transfer", "sync_weights", "advantages") else (
            f"{stage}/{model.removeprefix('shadow_')}")
        per_rank[key][event["pid"]] += event["dur"] / 1e6
    return {key: statistics.fmean(ranks.values()) for key, ranks in per_rank.items()}


def run_config(world: int, placement: str, arch: dict, args: argparse.Namespace,
               out: Path, layout: str = "packed") -> dict:
    """One ``tools/run_ppo.py`` run; the figures of its steps after the first."""
    arch_override = "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in arch.items()) + "}"
    run_dir = out / f"ws{world}_{placement}_{layout}"
    micro = max(1, args.batch // (world * 2))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), str(ROOT / "tools" / "run_ppo.py"),
               "--placement", placement, "--steps", str(args.steps), "--run-dir", str(run_dir),
               f"models.arch={arch_override}", "models.params_dtype=float32",
               f"rollout.prompts_per_step={args.batch}",
               f"rollout.max_prompt_length={args.prompt_length}",
               f"rollout.micro_batch_size={micro}", "rollout.ppo_epochs=1",
               "rollout.num_minibatches=1", f"generation.max_new_tokens={args.response_length}",
               "generation.stop_at_eos=false", "trace=true", "evaluation.num_prompts=0",
               f"models.packed_sequences={str(layout == 'packed').lower()}", *args.overrides]
    if placement == "separation-async":
        command[command.index("separation-async")] = "separation"
        command.append("rollout.async_rollout=true")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n"
                           + "\n".join(done.stderr.splitlines()[-30:]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_seconds" in r]
    timeline = json.loads((run_dir / "timeline.json").read_text())
    starts = sorted(e["ts"] for e in timeline["traceEvents"] if e.get("cat") == "generate")
    # the second step's first generation span marks the end of the warm-up step
    warm = starts[len(starts) // args.steps] if len(starts) >= args.steps else 0.0
    measured = steps[1:] or steps
    real = statistics.mean(r["prompt_length"] + r["response_length"] for r in measured)
    return {"step_seconds": statistics.median(r["step_seconds"] for r in measured),
            "padded_token_share": 1 - real / (args.prompt_length + args.response_length),
            "stages": stage_seconds(timeline, warm), "measured_steps": len(measured),
            "generation_work": generation_work(timeline, warm)}


def figures(world: int, placement: str, arch_fields: dict, args: argparse.Namespace,
            rates: dict[str, float], out: Path, layout: str = "packed") -> dict:
    arch = ArchSpec("benchmark", **arch_fields)
    run = run_config(world, placement, arch_fields, args, out, layout)
    work = run["generation_work"]
    flops = {"generate": generation_flops(arch, work) / run["measured_steps"],
             **step_flops(arch, args.batch, args.prompt_length, args.response_length)}
    peak = rates["square"]
    stages = {}
    for key, seconds in sorted(run["stages"].items()):
        entry = {"seconds": round(seconds / run["measured_steps"], 4)}
        if key in flops and seconds > 0:
            achieved = flops[key] * run["measured_steps"] / seconds
            # the stage's FLOP over its wall time: DP replicas run their shares side by side
            entry.update(flop=round(flops[key]), achieved_flop_per_s=round(achieved),
                         roofline=round(achieved / peak, 4))
        stages[key] = entry
    total = sum(flops.values())
    prefills = [w for w in work if not w.get("decode_context", 0)]
    widths = [w["prompt_width"] for w in prefills]
    return {"world_size": world, "placement": placement, "layout": layout,
            "padded_token_share": round(run["padded_token_share"], 4), "shape": args.shape,
            "batch": args.batch, "prompt_length": args.prompt_length,
            "response_length": args.response_length,
            "generation_prompt_widths": [min(widths), max(widths)],
            "generation_micro_batches": len(prefills),
            "generation_decode_steps": sum(w["forwards"] for w in work
                                           if w.get("decode_context", 0)),
            "samples_per_s": round(args.batch / run["step_seconds"], 3),
            "step_seconds": round(run["step_seconds"], 4), "step_flop": round(total),
            "step_roofline": round(total / run["step_seconds"] / peak, 4),
            "matmul_flop_per_s": {k: round(v) for k, v in rates.items()}, "stages": stages}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--placements", nargs="+",
                        default=["flattening", "interleaving", "separation", "separation-async"],
                        help="at world size 2 and more; world size 1 runs flattening")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", choices=("packed", "padded"), default=["packed"],
                        help="sequence layouts of the full forwards, each a run of its own")
    parser.add_argument("--square", type=int, default=2048)
    parser.add_argument("overrides", nargs="*", help="more section.key=value for run_ppo")
    args = parser.parse_args(argv)
    arch = SHAPES[args.shape]
    h, ffn, v = arch["hidden_size"], arch["ffn_hidden_size"], arch["vocab_size"]
    tokens = args.batch * (args.prompt_length + args.response_length)
    rates = {"square": matmul_rate(args.square, args.square, args.square),
             "train_mlp": matmul_rate(tokens, h, ffn), "train_lm_head": matmul_rate(tokens, h, v),
             "decode_mlp": matmul_rate(args.batch, h, ffn)}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            for placement in (["flattening"] if world == 1 else args.placements):
                for layout in args.layouts:
                    print(json.dumps(figures(world, placement, arch, args, rates, Path(tmp),
                                             layout)), flush=True)


if __name__ == "__main__":
    main()
