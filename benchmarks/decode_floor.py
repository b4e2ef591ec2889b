"""What bounds a decode step at ppo_step's shape: its FLOP, or the host work per op (the floor).

    .venv/bin/python benchmarks/decode_floor.py                 # ppo_step's shape, 2 threads
    .venv/bin/python benchmarks/decode_floor.py --rounds 3      # quicker, noisier
    .venv/bin/python benchmarks/decode_floor.py --compile-decode   # also the compiled decode

One process, TP=1, fp32, 2 intra-op threads (what ``ppo_step.py`` gives a world-size-1 run),
the project's own model builder and ``generate_sequences`` with what ``ppo_step.py`` runs: 32
prompts of 32 tokens, 32 new tokens, temperature 1, ``stop_at_eos=False``. Two models of the
same depth, heads and layer spec (RMSNorm, RoPE, SwiGLU, SDPA, ``CachedRopeSelfAttention``):

* ``full``: ppo_step's shape (hidden 256, ffn 688, vocab 512);
* ``floor``: the same with hidden = 8 x heads and ffn = hidden (vocab kept, so sampling is the
  same); its decode step has ~1/60 of the FLOP, so its time is the host work of a step:
  Python, megatron's module dispatch, aten dispatch of every op, sampling.

Each round times, alternating, ``generate_sequences`` with ``R`` new tokens and with 1, on each
model. A decode step (one cached forward of one token per row, plus its sampling) is
``(T(R) - T(1)) / (R - 1)``: the two calls share the prefill. Every round also re-measures the
matmul rates below and derives its own figures from its own minute of the (shared) machine; the
JSON holds the medians of those per-round figures over the rounds after a warm-up round. Every
round must give bitwise the same tokens.

FLOP of a decode step at context ``c`` (``ppo_step.forward_flops(arch, B, c)``):
    2 * B * N_matmul + 4 * L * h * c * B,  averaged over the contexts P + 1 .. P + R - 1
where ``N_matmul`` is the weights of the step's GEMMs (per layer QKV [h, h + 2 kv], projection
[h, h], SwiGLU fc1 [h, 2 ffn] and fc2 [ffn, h]; the LM head [h, V]; :func:`decode_gemms`).
Its time is taken at two rates measured in the same process: the large-square fp32 matmul
(``--square``; the roofline of ``ppo_step.py``) and each GEMM's own ``[B, k] x [k, n]`` rate
(attention's bmm FLOP at the square rate). With the floor unchanged, the best fraction of the
roofline a decode step could reach is
    best = flop_time_at_square / (flop_time_at_square + floor_step)
and the same for the whole call (``T_floor(R)`` in place of the floor). torch.profiler counts
the top-level aten ops (those not called by another aten op) of a decode step, by the same
difference of an ``R``-token and a 1-token call. ``unexplained_step_ms`` is what is left of the
full step after the floor and the GEMMs at their own rates: the non-GEMM work at the real widths
(attention over the cache, element-wise ops, norms).

``--compile-decode`` also runs both models with ``GenerationConfig.compile_decode`` (the decode
step through ``torch.compile``; its compilation happens in the warm-up round), alternating with
the eager path in each round: the same tokens are required, the largest log-prob difference is
reported, and the ``compiled_*`` figures are the same quantities for that path.

Prints one JSON line (times in ms, load average from ``os.getloadavg`` before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.generation import _single_rank_groups  # noqa: E402
from benchmarks.ppo_step import SHAPES, forward_flops, matmul_rate  # noqa: E402
from megatron_rlhf.generation import GenerationConfig, generate_sequences  # noqa: E402
from megatron_rlhf.topology.models import ArchSpec  # noqa: E402


def decode_gemms(arch: ArchSpec, batch: int) -> dict[str, tuple[int, int, int, int]]:
    """The GEMMs of one decode step: name -> ``(m, k, n, times per step)``."""
    h = arch.hidden_size
    kv = arch.num_query_groups * (h // arch.num_attention_heads)
    fc1 = (2 if arch.gated_mlp else 1) * arch.ffn_hidden_size
    layers = arch.num_layers
    return {"qkv": (batch, h, h + 2 * kv, layers), "proj": (batch, h, h, layers),
            "fc1": (batch, h, fc1, layers), "fc2": (batch, arch.ffn_hidden_size, h, layers),
            "lm_head": (batch, h, arch.padded_vocab_size(1), 1)}


def decode_step_flops(arch: ArchSpec, batch: int, prompt: int, new_tokens: int) -> float:
    """Mean FLOP of the ``new_tokens - 1`` decode steps (contexts prompt+1 .. prompt+new-1)."""
    contexts = range(prompt + 1, prompt + new_tokens)
    return statistics.fmean(forward_flops(arch, batch, c) for c in contexts)


def flop_seconds(arch: ArchSpec, batch: int, prompt: int, new_tokens: int,
                 square_rate: float, gemm_rates: dict[str, float]) -> dict[str, float]:
    """Seconds of a mean decode step's FLOP at the square rate and at its GEMMs' own rates."""
    total = decode_step_flops(arch, batch, prompt, new_tokens)
    gemm_flop = {name: 2 * m * k * n * times
                 for name, (m, k, n, times) in decode_gemms(arch, batch).items()}
    attention = total - sum(gemm_flop.values())
    own = sum(f / gemm_rates[name] for name, f in gemm_flop.items()) + attention / square_rate
    return {"at_square": total / square_rate, "at_own_shapes": own}


def timed_call(model, pgc, prompts: list[list[int]], new_tokens: int,
               compile_decode: bool = False):
    """``(seconds, output)`` of one ``generate_sequences`` call as ppo_step runs it."""
    config = GenerationConfig(max_new_tokens=new_tokens, seed=1, stop_at_eos=False,
                              compile_decode=compile_decode)
    start = time.perf_counter()
    out = generate_sequences(model, pgc, prompts, list(range(len(prompts))), config, None, 0)
    return time.perf_counter() - start, out


def top_level_aten(model, pgc, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """``(count, CPU us)`` of the aten ops of one call that no other aten op called."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_call(model, pgc, prompts, new_tokens)
    count, cpu_us = 0, 0.0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            count += 1
            cpu_us += event.cpu_time_total
    return count, cpu_us


def build(arch: ArchSpec, pgc):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights

    model = build_gpt_model(arch, ModelBuildOptions(params_dtype="float32"), pgc)
    init_weights(model, pgc, seed=0)
    return model


def measure_rounds(models: dict, pgc, prompts, new_tokens: int, rounds: int, square: int,
                   gemms: dict[str, tuple[int, int, int, int]], compiled: bool) -> list[dict]:
    """Per round: each model's call and decode-step seconds (eager, then compiled when asked),
    then the matmul rates.

    The models, paths and call lengths alternate, and the rates are re-measured in every round,
    so that each round's ratios come from the same minute of a shared machine. Every call must
    give the tokens of the model's first eager call; the compiled path's largest log-prob
    difference from the eager call of its round is recorded.
    """
    records, reference = [], {}
    for round_ in range(rounds + 1):  # round 0 is the warm-up (and compiles)
        record = {}
        for name, model in models.items():
            eager = None
            for compile_decode in (False, True) if compiled else (False,):
                long, out = timed_call(model, pgc, prompts, new_tokens, compile_decode)
                short, _ = timed_call(model, pgc, prompts, 1, compile_decode)
                reference.setdefault(name, out.input_ids)
                key = f"{name}_compiled" if compile_decode else name
                if not torch.equal(out.input_ids, reference[name]):
                    raise RuntimeError(f"{key}: tokens differ from the first eager call")
                record[key] = {"call_s": long, "step_s": (long - short) / (new_tokens - 1)}
                if compile_decode:
                    record[key]["logprob_diff"] = float(
                        (out.response_logprobs - eager).abs().max())
                eager = out.response_logprobs
        record["square"] = matmul_rate(square, square, square, seconds=0.3)
        record["gemms"] = {name: matmul_rate(m, k, n, seconds=0.05)
                           for name, (m, k, n, _) in gemms.items()}
        if round_:
            records.append(record)
    return records


def compiled_figures(record: dict, step_flop_s: float, call_flop_s: float,
                     own_shapes_s: float) -> dict[str, float]:
    """One round's figures of the compiled decode path against the eager one."""
    full, floor = record["full_compiled"], record["floor_compiled"]
    return {
        "compiled_full_call_ms": full["call_s"] * 1e3,
        "compiled_floor_call_ms": floor["call_s"] * 1e3,
        "compiled_full_step_ms": full["step_s"] * 1e3,
        "compiled_floor_step_ms": floor["step_s"] * 1e3,
        "compiled_call_speedup": record["full"]["call_s"] / full["call_s"],
        "compiled_step_speedup": record["full"]["step_s"] / full["step_s"],
        "compiled_floor_speedup": record["floor"]["step_s"] / floor["step_s"],
        "compiled_step_roofline": step_flop_s / full["step_s"],
        "compiled_call_roofline": call_flop_s / full["call_s"],
        "compiled_unexplained_step_ms": (full["step_s"] - floor["step_s"] - own_shapes_s) * 1e3,
        "best_step_roofline_with_compiled_floor": step_flop_s / (step_flop_s + floor["step_s"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--square", type=int, default=2048)
    parser.add_argument("--compile-decode", action="store_true",
                        help="also time both models with GenerationConfig.compile_decode")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    full = ArchSpec("ppo-step", **SHAPES["default"])
    heads = full.num_attention_heads
    tiny = ArchSpec("floor", **{**SHAPES["default"], "hidden_size": 8 * heads,
                                "ffn_hidden_size": 8 * heads})
    pgc = _single_rank_groups()
    torch.manual_seed(0)
    models = {"full": build(full, pgc), "floor": build(tiny, pgc)}
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, full.vocab_size, (args.batch, args.prompt_length),
                            generator=generator).tolist()
    gemms = decode_gemms(full, args.batch)
    records = measure_rounds(models, pgc, prompts, args.new_tokens, args.rounds, args.square,
                             gemms, args.compile_decode)
    ops = {}
    for name, model in models.items():
        long, short = (top_level_aten(model, pgc, prompts, n) for n in (args.new_tokens, 1))
        ops[name] = ((long[0] - short[0]) / (args.new_tokens - 1),
                     (long[1] - short[1]) / (long[0] - short[0]))
    step_flop = decode_step_flops(full, args.batch, args.prompt_length, args.new_tokens)
    call_flop = (forward_flops(full, args.batch * args.prompt_length, args.prompt_length)
                 + (args.new_tokens - 1) * step_flop)

    def derived(r: dict) -> dict[str, float]:
        flop_s = flop_seconds(full, args.batch, args.prompt_length, args.new_tokens,
                              r["square"], r["gemms"])
        step, floor = r["full"]["step_s"], r["floor"]["step_s"]
        call_flop_s = call_flop / r["square"]
        return {
            "full_call_ms": r["full"]["call_s"] * 1e3, "floor_call_ms": r["floor"]["call_s"] * 1e3,
            "full_step_ms": step * 1e3, "floor_step_ms": floor * 1e3,
            "floor_share_of_step": floor / step,
            "step_flop_ms_at_square": flop_s["at_square"] * 1e3,
            "step_flop_ms_at_own_shapes": flop_s["at_own_shapes"] * 1e3,
            "unexplained_step_ms": (step - floor - flop_s["at_own_shapes"]) * 1e3,
            "step_roofline": flop_s["at_square"] / step,
            "call_roofline": call_flop_s / r["full"]["call_s"],
            "best_step_roofline_with_floor": flop_s["at_square"] / (flop_s["at_square"] + floor),
            "best_call_roofline_with_floor": call_flop_s / (call_flop_s + r["floor"]["call_s"]),
            "square_gflop_per_s": r["square"] / 1e9,
            **{f"{k}_gflop_per_s": v / 1e9 for k, v in r["gemms"].items()},
            **(compiled_figures(r, flop_s["at_square"], call_flop_s,
                                  flop_s["at_own_shapes"]) if args.compile_decode else {})}

    per_round = [derived(r) for r in records]
    logprob_diff = max((r[k]["logprob_diff"] for r in records for k in r if "compiled" in k),
                       default=None)
    medians = {key: round(statistics.median(d[key] for d in per_round), 4) for key in per_round[0]}
    print(json.dumps({
        "threads": args.threads, "rounds": args.rounds, "batch": args.batch,
        "prompt_length": args.prompt_length, "new_tokens": args.new_tokens,
        "floor_arch": {"hidden_size": tiny.hidden_size, "ffn_hidden_size": tiny.ffn_hidden_size},
        "step_flop": round(step_flop), "floor_step_flop": round(
            decode_step_flops(tiny, args.batch, args.prompt_length, args.new_tokens)),
        "aten_ops_per_step": {name: round(o[0], 1) for name, o in ops.items()},
        "profiled_aten_us_per_op": {name: round(o[1], 1) for name, o in ops.items()},
        "floor_us_per_op": round(medians["floor_step_ms"] / ops["full"][0] * 1e3, 2),
        "median": medians,
        **({"compiled_tokens_bitwise_equal": True, "compiled_max_abs_logprob_diff": logprob_diff}
           if args.compile_decode else {}),
        "loadavg": [round(x, 2) for x in (*load_before, *os.getloadavg())],
    }))


if __name__ == "__main__":
    main()
