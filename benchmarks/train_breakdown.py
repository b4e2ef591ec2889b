"""Where an actor training step's time goes at ppo_step's shape: GEMMs, or everything else.

    .venv/bin/python benchmarks/train_breakdown.py              # ppo_step's shape, 2 threads
    .venv/bin/python benchmarks/train_breakdown.py --rounds 3   # quicker, noisier

One process, TP=1, fp32, 2 intra-op threads (what ``ppo_step.py`` gives a world-size-1 run). The
actor is built as ``tools/run_ppo.py`` builds it at ppo_step's world-size-1 configuration: its
default config (``examples/ppo_tiny.yaml``) with ppo_step's architecture and overrides,
``role_options`` for the actor, ``build_model``, ``ModelTrainer`` with ``actor_optimizer``
(megatron DDP, distributed optimizer, Adam, clip 1.0), a ``ModelWorker`` with ppo_step's
micro-batch (``batch // 2`` rows) and ``actor_loss_fn``. One training step is
``worker.train(rows, loss_fn)``: megatron's schedule over the micro-batches (forward, clipped
policy loss on the response log-probs, backward), the finiteness check and the optimizer step,
on ``batch`` rows of ``prompt + response`` tokens.

Each round measures the large-square fp32 matmul rate (``--square``, the roofline of
``ppo_step.py``), times one step without the profiler, runs one step under ``torch.profiler`` (CPU,
with shapes) and measures the square rate again (the round's rate is the geometric mean of the two,
its sustained rate as ``ppo_step.py`` measures it; the best single call of the two,
:func:`square_rates`, is reported as well: on a shared machine it is nearer what the cores give when
no other job holds them); every figure is computed per round and the JSON holds the medians over the
rounds after a warm-up round. In the profiled step every event's self CPU time goes to one category,
by the outermost classified op or scope around it (:func:`classify`): ``gemm`` (aten mm, addmm, bmm,
matmul, linear, their backward nodes, megatron's linear autograd function), ``attention`` (SDPA
forward and backward), ``loss`` (everything the loss function runs, and the backward nodes of those
ops, matched by autograd sequence number: the softmax normaliser over the vocabulary, gather, the
clipped ratio), ``optimizer`` (gradient accumulation into megatron's buffers, the finiteness check,
zeroing, ``finalize_model_grads``, the optimizer step), ``elementwise`` (every other aten op:
RMSNorm, RoPE, SwiGLU, residual adds, views and copies) and ``host`` (time in no aten op: Python,
megatron's module code, the autograd engine). Self times partition the step scope's profiled time,
so the categories sum to it; ``categories_over_wall`` compares that sum with the profiled step's
wall clock, and the profiler's own cost is ``profiled_step_s / step_s - 1``. Shares are of the
profiled step.

Model FLOP of the step (``ppo_step.py``): ``3 * forward(B * S, S)`` with
``forward(tokens, context) = tokens * (2 * N_matmul + 4 * L * h * context)``; its GEMM part,
``6 * B * S * N_matmul``, is checked against the FLOP of the profiled GEMM calls
(``2 m k n`` from their recorded shapes, :func:`gemm_flop`). Rates and fractions:

    gemm_rate       = profiled GEMM FLOP / GEMM seconds      (against the square rate)
    step_roofline   = step FLOP / square rate / step_s       (what ppo_step reports for training)
    best_if_rest_zero = step FLOP / square rate / gemm_s     (GEMMs as measured, nothing else)
    best_if_gemm_at_square = step FLOP / square rate / (step FLOP / square rate + non-GEMM s)

with ``gemm_s`` and the non-GEMM seconds the profiled shares times the unprofiled ``step_s``.
The GEMM calls are also grouped by shape (``m x k x n`` of ``[m, k] @ [k, n]``; forward and the
two backward products of each projection): milliseconds in the profiled step, rate against the
square rate, and the rate of the same product repeated alone in a loop right after the step
(``ppo_step.matmul_rate``, 0.1 s a shape) against the square rate, slowest total first.
``gemm_best_calls_*`` is the step's GEMM FLOP at the rate of each shape's fastest call in the
step, against the square's fastest call: on a shared machine the nearest to the idle ratio.
``gemm_alone_*`` is the step's GEMM FLOP at those alone rates, ``gemm_rate_of_alone`` the
in-step rate over it (below 1: the GEMMs run slower inside the step than alone, with the caches
and threads the other ops leave them).

Prints one JSON line (load average from ``os.getloadavg`` before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ppo_step import SHAPES, forward_flops, matmul_rate, matmul_weights  # noqa: E402
from megatron_rlhf.topology.models import ArchSpec, ModelSpec  # noqa: E402

CATEGORIES = ("gemm", "attention", "elementwise", "loss", "optimizer", "host")
LOSS_SCOPE = "train_breakdown/loss"
OPTIMIZER_SCOPE = "train_breakdown/optimizer"
STEP_SCOPE = "train_breakdown/step"
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
            "aten::linear", "aten::mv", "aten::addmv"}
FLOP_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
GEMM_BACKWARD = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward",
                 "MvBackward", "LinearWithGradAccumulation")
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def classify(name: str) -> str | None:
    """The category an event of this name claims for everything it runs, or None (it claims
    nothing: its time goes with an enclosing event's, or to ``host``)."""
    if name == LOSS_SCOPE:
        return "loss"
    if name == OPTIMIZER_SCOPE or name.startswith("Optimizer."):
        return "optimizer"
    node = name.removeprefix(BACKWARD_PREFIX)
    if "AccumulateGrad" in node:
        return "optimizer"
    if name in GEMM_OPS or node.startswith(GEMM_BACKWARD):
        return "gemm"
    if "scaled_dot_product" in node or "ScaledDotProduct" in node:
        return "attention"
    if name.startswith("aten::") or name.startswith(BACKWARD_PREFIX):
        return "elementwise"
    return None


def gemm_flop(name: str, shapes: list[list[int]]) -> int:
    """``2 m k n`` (times the batch for bmm) of one GEMM call from its recorded input shapes."""
    if name in ("aten::mm", "aten::bmm"):
        a, b = shapes[0], shapes[1]
    elif name in ("aten::addmm", "aten::baddbmm"):
        a, b = shapes[1], shapes[2]
    else:
        return 0
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def gemm_shape(name: str, shapes: list[list[int]]) -> str:
    """``"m x k x n"`` (``"b x m x k x n"`` for bmm) of one GEMM call."""
    a, b = (shapes[0], shapes[1]) if name in ("aten::mm", "aten::bmm") else (shapes[1], shapes[2])
    return " x ".join(str(d) for d in (*a, b[-1]))


def shape_dims(shape: str) -> tuple[int, int, int]:
    """``(m, k, n)`` of a :func:`gemm_shape` key (a bmm's batch folded into ``m``)."""
    *batch, m, k, n = (int(d) for d in shape.split(" x "))
    return m * (batch[0] if batch else 1), k, n


def event_category(event, loss_sequences: set[int]) -> str:
    """The outermost category claimed by the event or an enclosing one; backward nodes of
    forward ops the loss function ran are ``loss``."""
    category = None
    node = event
    while node is not None:
        claimed = classify(node.name)
        if node.name.startswith(BACKWARD_PREFIX) and node.sequence_nr in loss_sequences:
            claimed = "loss"
        if claimed is not None:
            category = claimed
            if claimed in ("loss", "optimizer"):
                break  # scopes win over the ops inside them
        node = node.cpu_parent
    return category or "host"


def loss_sequence_numbers(events) -> set[int]:
    """Autograd sequence numbers of the forward ops the loss function ran.

    An op run without grad records the counter's next value, which the next differentiable op
    (outside the loss, say the next micro-batch's embedding) takes too: a number that any forward
    op outside the loss scope carries is left out.
    """
    inside, outside = set(), set()
    for event in events:
        scope, node = None, event
        while node is not None and scope is None:
            if node.name == LOSS_SCOPE or node.name.startswith(BACKWARD_PREFIX):
                scope = node.name
            node = node.cpu_parent
        if event.sequence_nr < 0 or (scope or "").startswith(BACKWARD_PREFIX):
            continue  # the ops of the backward pass carry their node's number
        (inside if scope == LOSS_SCOPE else outside).add(event.sequence_nr)
    return inside - outside


def breakdown(events, root_name: str) -> dict:
    """Per-category self CPU seconds inside the ``root_name`` scopes, the GEMM FLOP, the GEMM
    calls by shape (``[FLOP, seconds, fastest call's FLOP/s]``) and the element-wise ops' times."""
    roots = [e for e in events if e.name == root_name]
    inside = []
    for event in events:
        node = event.cpu_parent
        while node is not None and node.name != root_name:
            node = node.cpu_parent
        if node is not None:
            inside.append(event)
    loss_sequences = loss_sequence_numbers(inside)
    seconds: dict[str, float] = defaultdict(float)
    seconds["host"] = sum(r.self_cpu_time_total for r in roots) / 1e6
    top_elementwise: Counter = Counter()
    flop = 0
    by_shape: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for event in inside:
        category = event_category(event, loss_sequences)
        seconds[category] += event.self_cpu_time_total / 1e6
        if category == "elementwise":
            top_elementwise[event.name.removeprefix(BACKWARD_PREFIX)] += event.self_cpu_time_total
        if category == "gemm" and event.name in FLOP_OPS:
            call_flop = gemm_flop(event.name, event.input_shapes)
            flop += call_flop
            entry = by_shape[gemm_shape(event.name, event.input_shapes)]
            entry[0] += call_flop
            entry[1] += event.cpu_time_total / 1e6
            entry[2] = max(entry[2], call_flop / max(event.cpu_time_total, 1) * 1e6)
    return {"seconds": {c: seconds[c] for c in CATEGORIES},
            "total_s": sum(r.cpu_time_total for r in roots) / 1e6, "gemm_flop": flop,
            "gemm_by_shape": dict(by_shape),
            "top_elementwise_us": dict(top_elementwise)}


def build_actor(args: argparse.Namespace):
    """``(worker, loss_fn, fields, arch)``: the actor as run_ppo builds it, its loss in the loss
    scope, and a batch of the shape."""
    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.builder.sources import role_options
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.execution.workers import ModelWorker
    from megatron_rlhf.engine.step.training_losses import actor_loss_fn
    from megatron_rlhf.models.trainer import ModelTrainer
    from megatron_rlhf.topology.groups import build_model_process_groups

    config = load_config(RunConfig, ROOT / "examples" / "ppo_tiny.yaml", [
        "models.params_dtype=float32", f"rollout.prompts_per_step={args.batch}",
        f"rollout.max_prompt_length={args.prompt_length}",
        f"rollout.micro_batch_size={max(1, args.batch // 2)}", "rollout.ppo_epochs=1",
        "rollout.num_minibatches=1", f"generation.max_new_tokens={args.response_length}"])
    arch = ArchSpec("ppo-step", **SHAPES["default"])
    pgc = build_model_process_groups(ModelSpec("actor", arch, trainable=True))
    options = replace(role_options(config, {}, "actor"), recompute=config.models.recompute_of(
        "actor"))
    model = build_model(arch, options, pgc, runtime_seed=config.runtime.seed,
                        init_seed=config.models.init_seed)
    updates = config.steps * config.rollout.ppo_epochs * config.rollout.num_minibatches
    trainer = ModelTrainer(model, pgc, config.actor_optimizer, total_steps=updates)
    worker = ModelWorker("actor", model, pgc, trainer, config.rollout.micro_batch_size)
    loss_fn = actor_loss_fn(worker, args.prompt_length, config.generation.temperature,
                            config.algorithm)
    generator = torch.Generator().manual_seed(0)
    rows, seq = args.batch, args.prompt_length + args.response_length
    fields = {"input_ids": torch.randint(0, arch.vocab_size, (rows, seq), generator=generator),
              "attention_mask": torch.ones(rows, seq, dtype=torch.long),
              "response_mask": torch.ones(rows, args.response_length),
              "old_logprobs": -6.2 + 0.1 * torch.randn(rows, args.response_length,
                                                      generator=generator),
              "advantages": torch.randn(rows, args.response_length, generator=generator)}
    return worker, _scoped(loss_fn, LOSS_SCOPE), fields, arch


def _scoped(fn, scope: str):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(scope):
            return fn(*args, **kwargs)
    return wrapped


def scope_optimizer_work(worker) -> None:
    """Put the trainer's gradient and optimizer calls in the optimizer scope (on this
    instance only; the calls are unchanged)."""
    trainer = worker.trainer
    trainer.optimizer.step = _scoped(trainer.optimizer.step, OPTIMIZER_SCOPE)
    trainer.optimizer.zero_grad = _scoped(trainer.optimizer.zero_grad, OPTIMIZER_SCOPE)
    trainer.module.zero_grad_buffer = _scoped(trainer.module.zero_grad_buffer, OPTIMIZER_SCOPE)
    trainer._gradients_finite = _scoped(trainer._gradients_finite, OPTIMIZER_SCOPE)
    config = worker.model.config
    config.finalize_model_grads_func = _scoped(config.finalize_model_grads_func, OPTIMIZER_SCOPE)


def profiled_step(worker, loss_fn, fields) -> tuple[float, dict]:
    """``(wall seconds, breakdown)`` of one training step under the profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        with record_function(STEP_SCOPE):
            worker.train(fields, loss_fn)
        elapsed = time.perf_counter() - start
    return elapsed, breakdown(prof.events(), STEP_SCOPE)


def square_rates(n: int, seconds: float = 0.3) -> tuple[float, float]:
    """``(sustained, best call)`` fp32 FLOP/s of ``[n, n] @ [n, n]`` over ``seconds``: the
    sustained rate is ``ppo_step.matmul_rate``'s; on a shared machine the best call is closer
    to what the cores give when no other job holds them."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    calls = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        call = time.perf_counter()
        a @ b
        calls.append(time.perf_counter() - call)
    flop = 2 * n ** 3
    return flop * len(calls) / (time.perf_counter() - start), flop / min(calls)


def measure_rounds(worker, loss_fn, fields, rounds: int, square: int) -> list[dict]:
    """Per round: a step without the profiler, a step under it, the step's GEMM shapes alone, and
    the square matmul rate before and after them (so each round's ratios come from the same few
    seconds of a shared machine)."""
    records = []
    for round_ in range(rounds + 1):  # round 0 is the warm-up
        before = square_rates(square)
        start = time.perf_counter()
        result = worker.train(fields, loss_fn)
        step_s = time.perf_counter() - start
        if not result["update_successful"]:
            raise RuntimeError("the optimizer skipped the update (non-finite gradients)")
        wall, parts = profiled_step(worker, loss_fn, fields)
        alone = {shape: matmul_rate(*shape_dims(shape), seconds=0.1)
                 for shape in parts["gemm_by_shape"]}
        after = square_rates(square)
        if round_:
            records.append({"step_s": step_s, "profiled_wall_s": wall, "parts": parts,
                            "square": (before[0] * after[0]) ** 0.5,
                            "square_best": max(before[1], after[1]), "alone": alone})
    return records


def round_figures(record: dict, step_flop: int) -> dict[str, float]:
    """One round's figures (module docstring)."""
    parts, step_s, square = record["parts"], record["step_s"], record["square"]
    total = parts["total_s"]
    share = {c: s / total for c, s in parts["seconds"].items()}
    gemm_s = share["gemm"] * step_s
    flop_s = step_flop / square
    gemm_rate = parts["gemm_flop"] / parts["seconds"]["gemm"]
    alone_rate = parts["gemm_flop"] / sum(f / record["alone"][shape]
                                          for shape, (f, *_) in parts["gemm_by_shape"].items())
    best_call_rate = parts["gemm_flop"] / sum(f / best
                                              for f, _, best in parts["gemm_by_shape"].values())
    return {
        "step_s": step_s, "profiled_step_s": record["profiled_wall_s"],
        "profiler_overhead": record["profiled_wall_s"] / step_s - 1,
        "categories_over_wall": sum(parts["seconds"].values()) / record["profiled_wall_s"],
        "square_gflop_per_s": square / 1e9,
        **{f"ms/{c}": s * 1e3 for c, s in parts["seconds"].items()},
        **{f"share/{c}": v for c, v in share.items()},
        "non_gemm_share": 1 - share["gemm"],
        "square_best_call_gflop_per_s": record["square_best"] / 1e9,
        "gemm_gflop_per_s": gemm_rate / 1e9, "gemm_rate_of_square": gemm_rate / square,
        "gemm_rate_of_square_best_call": gemm_rate / record["square_best"],
        "gemm_best_calls_gflop_per_s": best_call_rate / 1e9,
        "gemm_best_calls_of_square_best_call": best_call_rate / record["square_best"],
        "gemm_alone_gflop_per_s": alone_rate / 1e9,
        "gemm_rate_of_alone": gemm_rate / alone_rate,
        "gemm_alone_rate_of_square": alone_rate / square,
        **{f"gemm_rate_of_square/{shape}": f / t / square
           for shape, (f, t, _) in parts["gemm_by_shape"].items()},
        **{f"gemm_alone_rate_of_square/{shape}": record["alone"][shape] / square
           for shape in parts["gemm_by_shape"]},
        **{f"gemm_ms/{shape}": t * 1e3 for shape, (_, t, _) in parts["gemm_by_shape"].items()},
        "step_roofline": flop_s / step_s,
        "best_if_rest_zero": flop_s / gemm_s,
        "best_if_gemm_at_square": flop_s / (flop_s + (1 - share["gemm"]) * step_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--square", type=int, default=2048)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    torch.manual_seed(0)
    worker, loss_fn, fields, arch = build_actor(args)
    scope_optimizer_work(worker)
    records = measure_rounds(worker, loss_fn, fields, args.rounds, args.square)
    seq = args.prompt_length + args.response_length
    tokens = args.batch * seq
    step_flop = 3 * forward_flops(arch, tokens, seq)
    per_round = [round_figures(r, step_flop) for r in records]
    medians = {k: round(statistics.median(d[k] for d in per_round), 4) for k in per_round[0]}
    shapes = {k[8:]: [medians.pop(k), medians.pop(f"gemm_rate_of_square/{k[8:]}"),
                      medians.pop(f"gemm_alone_rate_of_square/{k[8:]}")]
              for k in list(medians) if k.startswith("gemm_ms/")}
    elementwise: Counter = Counter()
    for record in records:
        elementwise.update(record["parts"]["top_elementwise_us"])
    gemm_flops = {r["parts"]["gemm_flop"] for r in records}
    print(json.dumps({
        "threads": args.threads, "rounds": args.rounds, "batch": args.batch, "seq": seq,
        "micro_batch": worker.micro_batch_size, "step_flop": step_flop,
        "formula_gemm_flop": 6 * tokens * matmul_weights(arch, value_head=False),
        "profiled_gemm_flop": sorted(gemm_flops),
        "median": medians,
        "gemm_by_shape_ms_rate_alone_rate": dict(
            sorted(shapes.items(), key=lambda item: -item[1][0])),
        "step_s_min": round(min(d["step_s"] for d in per_round), 4),
        "top_elementwise_ms": {k: round(v / len(records) / 1e3, 2)
                               for k, v in elementwise.most_common(12)},
        "loadavg": [round(x, 2) for x in (*load_before, *os.getloadavg())],
    }))


if __name__ == "__main__":
    main()
