"""Rollouts: the static decode loop against continuous batching, and the GPU check's decode figures.

    .venv/bin/python benchmarks/rollouts.py               # CPU comparison, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/rollouts.py --gpu-check   # GPU figures (tiny shapes on CPU)

One process (a gloo world of one), TP=1. Prints one JSON line.

Default mode (fp32, ``benchmarks/ppo_step.py``'s default shape: 4 layers, hidden 256): 64 prompts
of 6-15 random tokens (the shipped task's prompt lengths), at most 32 new tokens, sampled at
temperature 1. A random model has no notion of an answer's end, so the shipped task's short,
uneven answers are stood in for by ``--end-ids`` end tokens (a tenth of the vocabulary: about one
token in ten ends a reply, lengths spread over 1-32, most under 16). For ``generation.batching``
static and continuous, at ``micro_batch_size`` 0 (all prompts together) and 16, and with every
response at full length (``stop_at_eos=False``), it reports the best of ``--repeats``
interleaved calls: ``tokens_per_s`` (generated tokens, prefill included, per second of the
call), ``row_steps`` (decode rows computed), ``generate_flops_fraction_of_matmul`` (the model
FLOP counted as ``ppo_step.generation_flops`` does, per second, over the 2048^3 fp32 matmul rate
measured in the same process), and checks that both loops drew the same tokens.
On CPU, ``cpu_compat_mode_cost`` is what generation saves by leaving the compatibility layer's
CUDA-to-CPU mode: a call's time with the mode kept over its time without, static and
continuous, all prompts together. ``--stop-check-intervals 1 2 4`` adds continuous batching at ``--micro-batch`` with those
``stop_check_interval`` values (a freed slot is refilled at the next check; the default is 8).

``--gpu-check`` (``scripts/gpu_check.sh``): bf16 on CUDA, ``stop_at_eos=False``:
* ``1.1b``: 22 layers, hidden 2048, 32 heads / 4 groups, prompt 128 + 128 new tokens, at batch 64
  and 256, continuous batching with CUDA graphs on and off: decode step ms ((T(128 tokens) -
  T(1 token)) / 127), tokens/s and the step's bytes (weights + mean KV) per second as a fraction
  of the device copy bandwidth measured here;
* ``1.1b_uneven``: the same shape at batch 256, answers ended by a tenth of the vocabulary:
  static against continuous batching (graphs as ``auto``; its slots shrink as answers end, one
  capture per slot count), tokens/s each, the slot counts it ran and the speed-up;
* ``7b``: 32 layers, hidden 4096, MHA, batch 64, 256 prompt + 256 new tokens: ms per decode step
  (graphs on);
* ``profile``: ``torch.profiler`` over 10 decode steps of the 1.1B shape at batch 64 (graphs as
  ``auto``): kernels per step, host (CPU) ms per step, GPU busy share of the wall time.
Without CUDA the same code runs fp32 at tiny shapes, and what needs a GPU (graphs, the profile's
kernels) is listed under ``skipped``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.generation import _single_rank_groups  # noqa: E402
from benchmarks.ppo_step import SHAPES, generation_flops, matmul_rate  # noqa: E402
from megatron_rlhf.generation import GenerationConfig, generate_sequences  # noqa: E402
from megatron_rlhf.runtime.patches import cpu_compat_active  # noqa: E402
from megatron_rlhf.topology.models import ArchSpec  # noqa: E402

ON_GPU = torch.cuda.is_available()
GPU_SHAPES = {
    "1.1b": dict(num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                 ffn_hidden_size=5632, vocab_size=32000),
    "7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
               ffn_hidden_size=11008, vocab_size=32000),
}
DRY_RUN_SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=128, vocab_size=256)


def _sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def _build(arch: ArchSpec, dtype: str):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights

    pgc = _single_rank_groups()
    model = build_gpt_model(arch, ModelBuildOptions(params_dtype=dtype), pgc)
    init_weights(model, pgc, seed=0)
    return model.eval(), pgc


def _timed(model, pgc, prompts, config, eos_ids) -> tuple[float, object]:
    _sync()
    start = time.perf_counter()
    out = generate_sequences(model, pgc, prompts, list(range(len(prompts))), config, eos_ids, 0)
    _sync()
    return time.perf_counter() - start, out


def compare_loops(args: argparse.Namespace) -> dict:
    """The default mode: static against continuous on CPU (module docstring)."""
    shape = SHAPES["default"]
    arch = ArchSpec("rollouts", **shape)
    model, pgc = _build(arch, "float32")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (int(n),), generator=generator).tolist()
               for n in torch.randint(6, 16, (args.prompts,), generator=generator)]
    end_ids = list(range(arch.vocab_size - args.end_ids, arch.vocab_size))
    base = GenerationConfig(max_new_tokens=args.new_tokens, seed=1)
    cases = {f"{batching}_mb{mb}{suffix}": dataclasses.replace(
                 base, batching=batching, micro_batch_size=mb, **fields)
             for suffix, fields in (("", {}), ("_full_length", {"stop_at_eos": False}))
             for mb in (0, args.micro_batch) for batching in ("static", "continuous")}
    for interval in args.stop_check_intervals:  # refills come at the stop checks
        cases[f"continuous_mb{args.micro_batch}_check{interval}"] = dataclasses.replace(
            base, micro_batch_size=args.micro_batch, stop_check_interval=interval)
    best = dict.fromkeys(cases, float("inf"))
    outputs = {}
    for config in cases.values():  # warm-up
        _timed(model, pgc, prompts, config, end_ids)
    for _ in range(args.repeats):
        for name, config in cases.items():
            seconds, outputs[name] = _timed(model, pgc, prompts, config, end_ids)
            best[name] = min(best[name], seconds)
    rate = matmul_rate(2048, 2048, 2048)
    result = {"matmul_2048_gflops": round(rate / 1e9, 1)}
    for name, out in outputs.items():
        work = [dataclasses.asdict(w) for w in out.micro_batches]
        flops = generation_flops(arch, work)
        tokens = int(out.response_lengths.sum())
        result[name] = {
            "seconds": round(best[name], 3), "tokens": tokens,
            "tokens_per_s": round(tokens / best[name], 1),
            "row_steps": sum(w["rows"] * (w["forwards"] - (0 if w["decode_context"] else 1))
                             for w in work),
            "generate_flops_fraction_of_matmul": round(flops / best[name] / rate, 3)}
        static = outputs[name.replace("continuous", "static").split("_check")[0]]
        if not torch.equal(out.input_ids, static.input_ids):
            raise RuntimeError(f"{name}: continuous batching drew other tokens than static")
    if cpu_compat_active():
        result["cpu_compat_mode_cost"] = _mode_cost(
            model, pgc, prompts, {name: cases[name] for name in ("static_mb0", "continuous_mb0")},
            end_ids, args.repeats)
    lengths = outputs[f"static_mb{args.micro_batch}"].response_lengths.float()
    result["response_lengths"] = {"mean": round(lengths.mean().item(), 1),
                                  "min": int(lengths.min()), "max": int(lengths.max())}
    for suffix in ("", "_full_length"):
        for mb in (0, args.micro_batch):
            result[f"speedup_mb{mb}{suffix}"] = round(
                result[f"continuous_mb{mb}{suffix}"]["tokens_per_s"]
                / result[f"static_mb{mb}{suffix}"]["tokens_per_s"], 2)
    return result


def _mode_cost(model, pgc, prompts, configs: dict, end_ids, repeats: int) -> dict:
    """Per case, a generate call's best time with the CUDA-to-CPU mode kept entered (as before
    ``generate_sequences`` left it) over its best time without (as it runs)."""
    import contextlib

    from megatron_rlhf.generation import generate as generate_module

    ratios = {}
    for name, config in configs.items():
        best = {}
        for kept in (True, False):
            suspend = generate_module.cuda_redirect_suspended
            if kept:
                generate_module.cuda_redirect_suspended = contextlib.nullcontext
            try:
                best[kept] = min(_timed(model, pgc, prompts, config, end_ids)[0]
                                 for _ in range(repeats + 1))
            finally:
                generate_module.cuda_redirect_suspended = suspend
        ratios[name] = round(best[True] / best[False], 2)
    return ratios


def _copy_bytes_per_s(device: torch.device) -> float:
    """Read + written bytes per second of a 1 GiB (64 MiB on CPU) device copy, best of 5."""
    src = torch.ones((2**28 if ON_GPU else 2**24), device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _sync()
        start = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def _decode_step_s(model, pgc, prompts, new_tokens: int, config: GenerationConfig,
                   repeats: int = 2) -> float:
    """(best T(new_tokens) - best T(1 token)) / (new_tokens - 1)."""
    one = min(_timed(model, pgc, prompts, dataclasses.replace(config, max_new_tokens=1), None)[0]
              for _ in range(repeats))
    full = float("inf")
    for _ in range(repeats):
        seconds, out = _timed(model, pgc, prompts, config, None)
        full = min(full, seconds)
        if int(out.response_lengths.min()) != new_tokens:
            raise RuntimeError(f"expected {new_tokens} tokens per prompt")
    return (full - one) / (new_tokens - 1)


def _step_bytes(model, arch: ArchSpec, batch: int, kv_len: float) -> float:
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "word_embeddings" not in n)
    size = next(model.parameters()).element_size()
    head_dim = arch.hidden_size // arch.num_attention_heads
    return weights + 2 * arch.num_layers * batch * kv_len * arch.num_query_groups * head_dim * size


def gpu_check(args: argparse.Namespace) -> dict:
    """The ``--gpu-check`` figures (module docstring)."""
    device = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    dtype = "bfloat16" if ON_GPU else "float32"
    copy = _copy_bytes_per_s(device)
    result: dict = {"device": torch.cuda.get_device_name() if ON_GPU else "cpu",
                    "copy_GBps": round(copy / 1e9, 1), "skipped": []}
    if not ON_GPU:
        result["skipped"] += ["cuda graphs (eager on CPU: graphs=on equals off)",
                              "profiler kernels (no CUDA kernels on CPU)", "bf16 (fp32 on CPU)"]
    prompt, new = (128, 128) if ON_GPU else (8, 8)
    batches = (64, 256) if ON_GPU else (2, 4)
    arch = ArchSpec("1.1b", seq_length=prompt + new,
                    **(GPU_SHAPES["1.1b"] if ON_GPU else DRY_RUN_SHAPE))
    model, pgc = _build(arch, dtype)
    generator = torch.Generator().manual_seed(0)
    shape_1b = {}
    for batch in batches:
        prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
        for graphs in ("auto", "off"):
            config = GenerationConfig(max_new_tokens=new, stop_at_eos=False, cuda_graphs=graphs,
                                      stop_check_interval=new)
            _timed(model, pgc, prompts, dataclasses.replace(config, max_new_tokens=2), None)
            step = _decode_step_s(model, pgc, prompts, new, config)
            moved = _step_bytes(model, arch, batch, prompt + new / 2)
            shape_1b[f"batch{batch}_graphs_{'on' if graphs == 'auto' else 'off'}"] = {
                "step_ms": float(f"{step * 1e3:.4g}"), "tokens_per_s": round(batch / step, 1),
                "fraction_of_copy_bandwidth": round(moved / step / copy, 3)}
    result["1.1b"] = shape_1b
    result["1.1b_uneven"] = _uneven_answers(model, pgc, arch, batches[-1], prompt, new, generator)
    result["profile"] = _profile(model, pgc, arch, batches[0], prompt, generator)
    del model
    if ON_GPU:
        torch.cuda.empty_cache()
    big_prompt, big_new = (256, 256) if ON_GPU else (8, 8)
    arch_7b = ArchSpec("7b", seq_length=big_prompt + big_new,
                       **(GPU_SHAPES["7b"] if ON_GPU else DRY_RUN_SHAPE))
    model, pgc = _build(arch_7b, dtype)
    batch = 64 if ON_GPU else 2
    prompts = torch.randint(0, arch_7b.vocab_size, (batch, big_prompt),
                            generator=generator).tolist()
    config = GenerationConfig(max_new_tokens=big_new, stop_at_eos=False,
                              stop_check_interval=big_new)
    _timed(model, pgc, prompts, dataclasses.replace(config, max_new_tokens=2), None)
    result["7b"] = {"batch": batch, "prompt": big_prompt, "new_tokens": big_new,
                    "step_ms": round(_decode_step_s(model, pgc, prompts, big_new, config) * 1e3,
                                     3)}
    return result


def _uneven_answers(model, pgc, arch: ArchSpec, batch: int, prompt: int, new: int,
                    generator) -> dict:
    """Static against continuous batching (graphs as ``auto``), all prompts in one batch, when a
    tenth of the vocabulary ends an answer: the continuous loop's slots shrink as answers end
    (one capture per slot count). Best of 2 calls each; raises if the loops' tokens differ."""
    prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
    end_ids = list(range(arch.vocab_size - arch.vocab_size // 10, arch.vocab_size))
    result, outputs = {}, {}
    for batching in ("static", "continuous"):
        config = GenerationConfig(max_new_tokens=new, batching=batching, seed=1)
        _timed(model, pgc, prompts, config, end_ids)
        seconds = float("inf")
        for _ in range(2):
            elapsed, outputs[batching] = _timed(model, pgc, prompts, config, end_ids)
            seconds = min(seconds, elapsed)
        tokens = int(outputs[batching].response_lengths.sum())
        result[batching] = {"seconds": round(seconds, 4), "tokens": tokens,
                            "tokens_per_s": round(tokens / seconds, 1)}
    if not torch.equal(outputs["static"].input_ids, outputs["continuous"].input_ids):
        raise RuntimeError("continuous batching drew other tokens than static")
    result["slot_counts"] = [w.rows for w in outputs["continuous"].micro_batches
                             if w.decode_context]
    result["speedup"] = round(result["continuous"]["tokens_per_s"]
                              / result["static"]["tokens_per_s"], 2)
    return result


def _profile(model, pgc, arch: ArchSpec, batch: int, prompt: int, generator) -> dict:
    """Kernels, host ms and GPU busy share per decode step over 10 steps (graphs as ``auto``)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
    steps = 10
    config = GenerationConfig(max_new_tokens=steps + 1, stop_at_eos=False,
                              stop_check_interval=steps + 1)
    _timed(model, pgc, prompts, config, None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    with profile(activities=activities) as prof:
        seconds, _ = _timed(model, pgc, prompts, config, None)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    host_us = sum(e.self_cpu_time_total for e in events)
    return {"steps": steps, "kernels_per_step": round(kernels / (steps + 1), 1),
            "host_ms_per_step": round(host_us / 1e3 / (steps + 1), 3),
            "gpu_busy_share": round(gpu_us / (seconds * 1e6), 3) if ON_GPU else None,
            "note": "per generate call of 1 prefill + 10 decode steps, divided by 11"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-check", action="store_true", help="the GPU check's figures")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--end-ids", type=int, default=51, help="end tokens (of 512)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    parser.add_argument("--stop-check-intervals", type=int, nargs="*", default=[],
                        help="also continuous batching at --micro-batch with these "
                             "stop_check_interval values (continuous_mb<N>_check<K>)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    start = time.perf_counter()
    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    with torch.no_grad():
        body = gpu_check(args) if args.gpu_check else compare_loops(args)
    print(json.dumps({"benchmark": "rollouts_gpu_check" if args.gpu_check else "rollouts",
                      "torch": torch.__version__, "threads": torch.get_num_threads(), **body,
                      "total_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
