"""Text reports of a prediction and of a ranking, for ``tools/plan_placement.py``."""

from __future__ import annotations

from megatron_rlhf.planner.predict import STAGES, StepPrediction
from megatron_rlhf.planner.search import RankedCandidate, explain_choice


def format_prediction(prediction: StepPrediction) -> str:
    """Samples/s, seconds per stage and per task, memory per device (with each model's memory
    options) and per node on the host, the generation micro-batch and the KV cache's room in
    sequences, the largest training micro-batch."""
    if not prediction.feasible:
        return "\n".join(["predicted: does not fit in memory"]
                         + [f"  - {problem}" for problem in prediction.problems])
    p, memory = prediction, prediction.memory
    mode = (f"pipelined, {p.mode}; {p.synchronous_step_seconds:.2f} s synchronous"
            if p.pipelined else "synchronous")
    lines = [
        f"predicted: {p.samples_per_s:.3f} samples/s, {p.step_seconds:.2f} s per step ({mode})",
        f"bottleneck: {p.bottleneck} ({p.bottleneck_share:.0%} of the critical work)",
        "",
        "stage          seconds",
        *(f"{stage:<14} {p.stage_seconds[stage]:>8.2f}" for stage in STAGES),
        "",
        f"{'task':<46} {'start':>8} {'seconds':>8} {'compute':>8} {'memory':>8} {'comm':>8} "
        f"{'overhead':>8} {'offload':>8}",
    ]
    for task in p.tasks:
        lines.append(f"{task['name']:<46} {task['start_s']:>8.2f} {task['seconds']:>8.2f} "
                     f"{task['compute_s']:>8.2f} {task['memory_s']:>8.2f} {task['comm_s']:>8.2f} "
                     f"{task['overhead_s']:>8.2f} {task['offload_s']:>8.2f}")
    lines += ["", f"{'memory per device, GiB':<24} {'weights':>8} {'grads':>8} {'optim':>8} "
                  f"{'activ':>8} {'kv':>8} {'total':>8}  options"]
    for role, m in memory.roles.items():
        lines.append(f"{role:<24} {m.weights:>8.2f} {m.grads:>8.2f} {m.optimizer:>8.2f} "
                     f"{m.activations:>8.2f} {m.kv_cache:>8.2f} {m.total:>8.2f}  "
                     f"{memory.options[role].label}")
    micro = ", ".join(f"{role} {n} rows" for role, n in memory.largest_micro_batch.items())
    rounds = ", ".join(f"{role} {n}" for role, n in memory.sequences_per_round.items())
    generation = ", ".join(f"{role} {n}" for role, n in memory.generation_micro_batch.items())
    lines += [
        "states GiB (placement table) = weights + grads + optim; total adds activ and kv",
        "",
        f"peak per device: {memory.peak_gib:.1f} GiB of {memory.usable_gib:.1f} usable",
        f"host per node: {memory.host_gib:.1f} GiB of offloaded states and host optimizers",
        f"generation micro-batch: {generation} sequences per replica",
        f"KV cache room: {rounds} sequences per replica, {memory.largest_batch} over all "
        "generating replicas in one round",
        f"largest training micro-batch: {micro}",
    ]
    return "\n".join(lines)


def format_ranking(ranked: list[RankedCandidate], top: int = 20) -> str:
    """The best ``top`` candidates, one line each, and why the first wins."""
    lines = [f"{'rank':>4} {'samples/s':>10} {'step s':>9}  {'bottleneck':<13} placement"]
    for candidate in ranked[:top]:
        p = candidate.prediction
        step = f"{p.step_seconds:>9.2f}" if p.feasible else f"{'-':>9}"
        lines.append(f"{candidate.rank:>4} {p.samples_per_s:>10.3f} {step}  "
                     f"{p.bottleneck:<13} {candidate.label}")
    if len(ranked) > top:
        lines.append(f"... {len(ranked) - top} more (--top to show them)")
    lines += ["", f"why: {explain_choice(ranked)}"]
    return "\n".join(lines)
