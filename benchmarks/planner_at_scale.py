"""The planner's predictions at scale: the tables of docs/planner.md, from one command.

    python benchmarks/planner_at_scale.py            # the tables, markdown (about 90 s on 2 cores)
    python benchmarks/planner_at_scale.py --json     # one JSON line per cell instead

Table 1: LLaMA 7B-65B (actor, critic, ref and reward the same size) on 1x8 to 16x8 A100-80GB,
the best candidate of flattening, interleaving, interleaving2 and separation each
(``auto_place`` with ``SearchSpace(strategies=(s,))``). Table 2: the same cells' settings: TP,
PP, DP and memory options of every model, and the predicted peak memory per device. Table 3: DeepSpeed-Chat's step-3 setting
(actor and ref LLaMA of the size nearest their OPT actor, critic and reward OPT-350M-shaped,
flattening) on 8 and 64 A100-80GB, to hold against their published times. The rollout is
DeepSpeed-Chat's benchmark: 1024 prompts per step, 256 prompt + 256 response tokens, one PPO
epoch and mini-batch, micro-batch 4, no activation checkpointing, distributed optimizer.
"""

from __future__ import annotations

import argparse
import json

from megatron_rlhf.planner import (
    RankedCandidate,
    SearchSpace,
    auto_place,
    homogeneous_cluster,
)
from megatron_rlhf.planner.paper import (
    PAPER_MODELS,
    PAPER_NODES,
    PAPER_ROLLOUT,
    PAPER_STRATEGIES,
)
from megatron_rlhf.topology.models import ArchSpec

OPT_350M = ArchSpec("opt-350m", 24, 1024, 16, 50272, 2048, 4096)
DEEPSPEED_CHAT = (
    # (their actor, our actor, GPUs, their step-3 time in hours for 264,292 samples)
    ("OPT-13B", "llama-13b", 8, 9.0),
    ("OPT-13B", "llama-13b", 64, 1.25),
    ("OPT-30B", "llama-33b", 8, 18.0),
    ("OPT-30B", "llama-33b", 64, 4.0),
    ("OPT-66B", "llama-65b", 8, 2.1 * 24),
    ("OPT-66B", "llama-65b", 64, 7.5),
)
DEEPSPEED_CHAT_SAMPLES = 264_292


def best_cell(nodes: int, models, strategy: str) -> dict:
    """The best candidate of ``strategy``: samples/s, label and bottleneck, or why none runs."""
    ranked = auto_place(homogeneous_cluster("A100-80GB", nodes, 8), models, PAPER_ROLLOUT,
                        space=SearchSpace(strategies=(strategy,)))
    if not ranked:
        return {"result": "refused"}
    best = ranked[0]
    if not best.prediction.feasible:
        return {"result": "OOM", "label": best.label}
    memory = best.prediction.memory
    return {"result": round(best.prediction.samples_per_s, 2), "label": best.label,
            "bottleneck": best.prediction.bottleneck, "setting": setting(best),
            "peak_gib_per_device": round(memory.peak_gib, 1)}


def setting(candidate: RankedCandidate) -> str:
    """Every model's TP/PP/DP and memory options, models with the same ones together, e.g.
    ``actor, critic 8/2/1 distributed_optimizer+offload; ref, reward 8/1/1 replicated``."""
    plan, options = candidate.plan, candidate.prediction.memory.options
    groups: dict[str, list[str]] = {}
    for role, model in plan.models.items():
        key = f"{model.tp}/{model.pp}/{model.dp} {options[role].label}"
        groups.setdefault(key, []).append(role)
    return "; ".join(f"{', '.join(roles)} {key}" for key, roles in groups.items())


def _text(cell: dict) -> str:
    if isinstance(cell["result"], str):
        return cell["result"]
    return f"{cell['result']:.2f} ({cell['label']}; {cell['bottleneck']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per cell")
    args = parser.parse_args()
    rows = []
    for model in PAPER_MODELS:
        for nodes in PAPER_NODES:
            cells = {s: best_cell(nodes, model, s) for s in PAPER_STRATEGIES}
            rows.append((model, nodes, cells))
            if args.json:
                for strategy, cell in cells.items():
                    print(json.dumps({"table": "at_scale", "model": model,
                                      "cluster": f"{nodes}x8", "strategy": strategy, **cell}))
    comparison = []
    for theirs, ours, gpus, hours in DEEPSPEED_CHAT:
        models = {"actor": ours, "ref": ours, "critic": OPT_350M, "reward": OPT_350M}
        cell = best_cell(gpus // 8, models, "flattening")
        measured = DEEPSPEED_CHAT_SAMPLES / (hours * 3600)
        ratio = cell["result"] / measured if not isinstance(cell["result"], str) else None
        comparison.append((theirs, ours, gpus, hours, measured, cell, ratio))
        if args.json:
            print(json.dumps({"table": "deepspeed_chat", "actor": theirs, "ours": ours,
                              "gpus": gpus, "measured_samples_per_s": round(measured, 2),
                              **cell, "predicted_over_measured": ratio and round(ratio, 2)}))
    if args.json:
        return
    print("| model | cluster | " + " | ".join(PAPER_STRATEGIES) + " |")
    print("|---|---|" + "---|" * len(PAPER_STRATEGIES))
    for model, nodes, cells in rows:
        texts = " | ".join(_text(cells[s]) for s in PAPER_STRATEGIES)
        print(f"| {model} | {nodes}x8 | {texts} |")
    print()
    print("| model | cluster | strategy | picked | TP/PP/DP and memory options | "
          "peak GiB/device |")
    print("|---|---|---|---|---|---|")
    for model, nodes, cells in rows:
        for strategy in PAPER_STRATEGIES:
            cell = cells[strategy]
            if isinstance(cell["result"], str):
                print(f"| {model} | {nodes}x8 | {strategy} | {cell['result']} | - | - |")
                continue
            print(f"| {model} | {nodes}x8 | {strategy} | {cell['label']} | {cell['setting']} | "
                  f"{cell['peak_gib_per_device']:.1f} |")
    print()
    print("| actor (theirs / ours) | GPUs | DeepSpeed-Chat time | measured samples/s | "
          "predicted samples/s | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for theirs, ours, gpus, hours, measured, cell, ratio in comparison:
        print(f"| {theirs} / {ours} | {gpus} x A100-80GB | {hours:g} h | {measured:.2f} | "
              f"{_text(cell)} | {f'{ratio:.2f}' if ratio else '-'} |")


if __name__ == "__main__":
    main()
