"""One PPO step against the machine's matmul roofline, stage by stage, through ``tools/run_ppo.py``.

    python benchmarks/ppo_step.py                         # the issue's shape, world sizes 1 and 2
    python benchmarks/ppo_step.py --shape large           # hidden 1024, 8 layers
    python benchmarks/ppo_step.py --world-sizes 2 --placements flattening separation

Each configuration is a real run: ``torchrun --standalone --nproc-per-node N tools/run_ppo.py``
with the architecture written out in the config (``models.arch`` as a mapping), ``trace=true``
and the shipped task's prompts left-padded to ``--prompt-length`` tokens, every response exactly
``--response-length`` tokens long (``generation.stop_at_eos=false``), fp32, one PPO epoch and one
mini-batch. The per-stage seconds come from the run's own timeline (``timeline.json``), averaged
over the steps after the first (warm-up) and, for each stage, over the ranks that ran it; the step
time is the median ``step_seconds`` of those steps.

In the same process, before the runs, it measures the machine's fp32 matmul rate: at a large
square shape (``--square``; the roofline) with every core, and at the step's own GEMM shapes (the
prefill/training projections and one decode step's), which bounds what a stage can reach.

Model FLOP per step, counted as executed (padded prompts included, causal attention as the
full square over the context):
    forward(tokens, context) = tokens * (2 * N_matmul + 4 * L * h * context)
    N_matmul = L * (h * (h + 2 * kv) + h * h + m * h * ffn) + h * V   (h for a scalar head)
    generation   = forward(B * P, P) + sum_{t < R} forward(B, P + t)
    experience   = forward(B * S, S) for each of actor, ref (LM head) and critic, reward (scalar)
    training     = 3 * forward(B * S, S) for actor and critic
with B prompts, P prompt and R response tokens, S = P + R, L layers, h hidden size, kv the width
of the keys (query groups x head size), m = 3 for SwiGLU (2 otherwise), V the padded vocabulary:
N_matmul counts the weights of every matrix product (not the embedding lookup, norms or biases). Achieved FLOP/s of a
stage = its FLOP / its seconds; "roofline" = that / the large-square rate (one line per
configuration, JSON).
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def matmul_weights(arch: ArchSpec, value_head: bool) -> int:
    """``N_matmul`` of the module docstring."""
    h, kv = arch.hidden_size, arch.num_query_groups * (arch.hidden_size // arch.num_attention_heads)
    layer = h * (h + 2 * kv) + h * h + (3 if arch.gated_mlp else 2) * h * arch.ffn_hidden_size
    return arch.num_layers * layer + h * (1 if value_head else arch.padded_vocab_size(1))


def forward_flops(arch: ArchSpec, tokens: int, context: int, value_head: bool = False) -> int:
    """``forward(tokens, context)`` of the module docstring."""
    attention = 4 * arch.num_layers * arch.hidden_size * context
    return tokens * (2 * matmul_weights(arch, value_head) + attention)


def step_flops(arch: ArchSpec, batch: int, prompt: int, response: int) -> dict[str, float]:
    """Model FLOP of each stage of one step (formula in the module docstring)."""
    seq = prompt + response
    flops = {"generate": forward_flops(arch, batch * prompt, prompt)
             + sum(forward_flops(arch, batch, prompt + t) for t in range(response))}
    for role, value_head in EXPERIENCE_ROLES.items():
        if not role.startswith("shadow"):
            flops[f"experience/{role}"] = forward_flops(arch, batch * seq, seq, value_head)
    for role in ("actor", "critic"):
        flops[f"train/{role}"] = 3 * forward_flops(arch, batch * seq, seq, role == "critic")
    return flops


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
               out: Path) -> dict:
    """One ``tools/run_ppo.py`` run; the figures of its steps after the first."""
    arch_override = "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in arch.items()) + "}"
    run_dir = out / f"ws{world}_{placement}"
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
               *args.overrides]
    if placement == "separation-async":
        command[command.index("separation-async")] = "separation"
        command.append("rollout.async_rollout=true")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        reasons = [line for line in done.stderr.splitlines() if line.startswith("run_ppo:")]
        raise RuntimeError(f"{' '.join(command)} failed:\n"
                           + "\n".join(reasons or done.stderr.splitlines()[-30:]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_seconds" in r]
    timeline = json.loads((run_dir / "timeline.json").read_text())
    starts = sorted(e["ts"] for e in timeline["traceEvents"] if e.get("cat") == "generate")
    # the second step's first generation span marks the end of the warm-up step
    warm = starts[len(starts) // args.steps] if len(starts) >= args.steps else 0.0
    measured = steps[1:] or steps
    return {"step_seconds": statistics.median(r["step_seconds"] for r in measured),
            "stages": stage_seconds(timeline, warm), "measured_steps": len(measured)}


def figures(world: int, placement: str, arch_fields: dict, args: argparse.Namespace,
            rates: dict[str, float], out: Path) -> dict:
    arch = ArchSpec("benchmark", **arch_fields)
    flops = step_flops(arch, args.batch, args.prompt_length, args.response_length)
    run = run_config(world, placement, arch_fields, args, out)
    peak = rates["square"]
    stages = {}
    for key, seconds in sorted(run["stages"].items()):
        entry = {"seconds": round(seconds / run["measured_steps"], 4)}
        if key in flops and seconds > 0:
            achieved = flops[key] * run["measured_steps"] / seconds
            # the stage's FLOP over its wall time: DP replicas run their shares side by side
            entry.update(flop=flops[key], achieved_flop_per_s=round(achieved),
                         roofline=round(achieved / peak, 4))
        stages[key] = entry
    total = sum(flops.values())
    return {"world_size": world, "placement": placement, "shape": args.shape,
            "batch": args.batch, "prompt_length": args.prompt_length,
            "response_length": args.response_length,
            "samples_per_s": round(args.batch / run["step_seconds"], 3),
            "step_seconds": round(run["step_seconds"], 4), "step_flop": total,
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
                print(json.dumps(figures(world, placement, arch, args, rates, Path(tmp))),
                      flush=True)


if __name__ == "__main__":
    main()
