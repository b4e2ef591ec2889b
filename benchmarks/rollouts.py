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

``--gpu-check`` (``scripts/gpu_check.sh``): bf16 on CUDA, ``stop_at_eos=False`` unless said,
random weights (megatron's own init, on the device):
* ``copy_GBps``: the device copy bandwidth (bytes read + written per second);
* ``1.1b``: 22 layers, hidden 2048, 32 heads / 4 groups, prompt 128 + 128 new tokens, at batch 64
  and 256, the continuous-batching decode step with CUDA graphs on and off: ms per step (the 127
  steps after the prefill's token, timed between two device syncs, prefill and capture outside;
  best of 2), tokens/s and the step's bytes (weights + mean KV) per second as a fraction of
  ``copy_GBps``;
* ``1.1b_uneven``: the same shape at batch 256, answers ended by a tenth of the vocabulary:
  static against continuous batching (graphs as ``auto``; its slots shrink as answers end, one
  capture per slot count), one warm-up and one timed generate call each: tokens/s each, the slot
  counts it ran, the speed-up, and ``match``: how far the two loops' tokens agree in bf16;
* ``loops_fp32``: the same comparison in fp32 without TF32 on a small model (4 layers, hidden
  512) at batch 64 with seeded weights, where the loops should draw the same tokens:
  ``token_match_fraction``, ``rows_equal_fraction``, ``max_logprob_diff`` (a figure, not an
  assertion);
* ``profile``: ``torch.profiler`` over 10 decode steps of the 1.1B shape at batch 64, graphs on
  and off: kernels, host (CPU) ms and wall ms per step, GPU busy share of the wall time;
* ``7b``: 32 layers, hidden 4096, MHA, batch 64, 256 prompt + 256 new tokens, graphs on: the
  ``1.1b`` figures (one timed pass).
A measurement that raises leaves ``{"error": ...}`` under its name (``errors`` lists them) and
the others still run; SIGTERM (the GPU check's time limit) ends the measuring, and the JSON line
is still printed. Exit status 1 when any measurement failed.
Without CUDA the same code runs fp32 at tiny shapes, and what needs a GPU (graphs, the profile's
kernels) is listed under ``skipped``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.generation import _single_rank_groups  # noqa: E402
from benchmarks.ppo_step import SHAPES, generation_flops, matmul_rate  # noqa: E402
from megatron_rlhf.generation import GenerationConfig, generate_sequences  # noqa: E402
from megatron_rlhf.runtime.patches import (  # noqa: E402
    cpu_compat_active,
    cuda_redirect_suspended,
)
from megatron_rlhf.topology.models import ArchSpec  # noqa: E402

ON_GPU = torch.cuda.is_available()
GPU_SHAPES = {
    "1.1b": dict(num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                 ffn_hidden_size=5632, vocab_size=32000, gated_mlp=True),
    "7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
               ffn_hidden_size=11008, vocab_size=32000, gated_mlp=True),
}
LOOPS_SHAPE = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                   ffn_hidden_size=1408, vocab_size=32000, gated_mlp=True)
"""The fp32 static-against-continuous comparison's model on a GPU (``loops_fp32``)."""
DRY_RUN_SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=128, vocab_size=256, gated_mlp=True)


def _sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def _build(arch: ArchSpec, dtype: str, init: bool = True):
    """The model and its groups; ``init``: seeded weights (``init_weights``, drawn on the host),
    else megatron's own random init."""
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights

    pgc = _single_rank_groups()
    model = build_gpt_model(arch, ModelBuildOptions(params_dtype=dtype), pgc)
    if init:
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


class _TimedOut(Exception):
    """SIGTERM: the GPU check's time limit for this part ran out."""


_SIGTERM: list[float] = []
"""When SIGTERM came (empty: not yet): an exception raised while unwinding from it (a CUDA
graph capture cut short) still counts as the time-out."""


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    _SIGTERM.append(time.perf_counter())
    raise _TimedOut("stopped by SIGTERM (the part's time limit)")


@dataclasses.dataclass
class _Decoding:
    """A :class:`SlotDecoder` with ``prompts`` prefilled (one slot each), ready to decode
    ``new_tokens - 1`` steps after the prefill's token; ``run`` is its CUDA graph when graphs are
    on (captured once, as a generate call does, and reused across refills)."""

    decoder: object
    run: object
    refill: object


def _decoding(model, prompts, new_tokens: int, graphs: bool) -> _Decoding:
    from megatron_rlhf.generation.decode_step import (
        DecodeGraph,
        DecodeSettings,
        SlotDecoder,
        SlotPrompt,
        batch_bucket,
        graphs_enabled,
        length_bucket,
    )
    from megatron_rlhf.generation.generate import _unwrap
    from megatron_rlhf.generation.sampling import prompt_noise_keys

    core = _unwrap(model)
    config = GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False,
                              cuda_graphs="auto" if graphs else "off")
    settings = DecodeSettings(config, None, 0, getattr(core, "token_vocab_size", core.vocab_size),
                              length_bucket(max(len(p) for p in prompts) + new_tokens))
    decoder = SlotDecoder(model, batch_bucket(len(prompts), 0), settings)
    keys = prompt_noise_keys(config.seed, range(len(prompts))).tolist()
    entering = [SlotPrompt(p, key, new_tokens, False) for p, key in zip(prompts, keys,
                                                                         strict=True)]

    def refill() -> None:
        decoder.prefill(range(len(prompts)), entering)

    refill()
    device = next(model.parameters()).device
    graph = DecodeGraph(decoder) if graphs_enabled(config, device) else None
    return _Decoding(decoder, graph or decoder, refill)


def _decode_step_s(model, prompts, new_tokens: int, graphs: bool, repeats: int = 2) -> float:
    """Seconds per decode step, best of ``repeats``: the ``new_tokens - 1`` steps after a prefill
    (the prefill samples the first token), timed between two device syncs, the prefill and the
    graph capture outside the timing. Raises unless every slot decoded all its tokens. Outside
    the CPU compatibility mode, as generation runs."""
    with cuda_redirect_suspended():
        return _decode_steps_s(model, prompts, new_tokens, graphs, repeats)


def _decode_steps_s(model, prompts, new_tokens: int, graphs: bool, repeats: int) -> float:
    decoding = _decoding(model, prompts, new_tokens, graphs)
    steps, best = new_tokens - 1, float("inf")
    for repeat in range(repeats):
        if repeat:
            decoding.refill()
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            decoding.run.step()
        _sync()
        best = min(best, time.perf_counter() - start)
        done = int(decoding.decoder.steps.min())
        if done != new_tokens:
            raise RuntimeError(f"a slot decoded {done} tokens, not {new_tokens}")
    return best / steps


def _step_bytes(model, arch: ArchSpec, batch: int, kv_len: float) -> float:
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "word_embeddings" not in n)
    size = next(model.parameters()).element_size()
    head_dim = arch.hidden_size // arch.num_attention_heads
    return weights + 2 * arch.num_layers * batch * kv_len * arch.num_query_groups * head_dim * size


def _decode_figures(model, arch: ArchSpec, batch: int, prompt: int, new: int, graphs: bool,
                    copy: float | None, generator, repeats: int = 2) -> dict:
    prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
    step = _decode_step_s(model, prompts, new, graphs, repeats)
    moved = _step_bytes(model, arch, batch, prompt + new / 2)
    return {"batch": batch, "prompt": prompt, "new_tokens": new, "timed_steps": new - 1,
            "step_ms": float(f"{step * 1e3:.4g}"), "tokens_per_s": round(batch / step, 1),
            "fraction_of_copy_bandwidth": round(moved / step / copy, 3) if copy else None}


def gpu_check(args: argparse.Namespace) -> dict:  # noqa: ARG001 - one signature for both modes
    """The ``--gpu-check`` figures (module docstring). Each measurement that raises (or is cut
    off by SIGTERM, the part's time limit) leaves ``{"error": ...}`` under its name, and those
    after a SIGTERM ``{"error": "not run: ..."}``; ``errors`` names them."""
    device = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    dtype = "bfloat16" if ON_GPU else "float32"
    result: dict = {"device": torch.cuda.get_device_name() if ON_GPU else "cpu", "skipped": []}
    if not ON_GPU:
        result["skipped"] += ["cuda graphs (eager on CPU: graphs=on equals off)",
                              "profiler kernels (no CUDA kernels on CPU)", "bf16 (fp32 on CPU)"]
    prompt, new = (128, 128) if ON_GPU else (8, 8)
    batches = (64, 256) if ON_GPU else (2, 4)
    arch = ArchSpec("1.1b", seq_length=prompt + new,
                    **(GPU_SHAPES["1.1b"] if ON_GPU else DRY_RUN_SHAPE))
    generator = torch.Generator().manual_seed(0)
    held: dict = {}

    def model_1b():
        if "1.1b" not in held:  # megatron's own init on the device: timing needs no seeded values
            held["1.1b"] = _build(arch, dtype, init=False)
        return held["1.1b"][0]

    def copy_gbps() -> float:
        return round(_copy_bytes_per_s(device) / 1e9, 1)

    def decode_1b() -> dict:
        copy = result["copy_GBps"] * 1e9 if isinstance(result.get("copy_GBps"), float) else None
        cases = {}
        for batch in batches:
            for graphs in (True, False):
                cases[f"batch{batch}_graphs_{'on' if graphs else 'off'}"] = _decode_figures(
                    model_1b(), arch, batch, prompt, new, graphs, copy, generator)
        return cases

    def uneven() -> dict:
        model = model_1b()
        return _uneven_answers(model, held["1.1b"][1], arch, batches[-1], prompt, new,
                               generator)

    def profile() -> dict:
        return {f"graphs_{'on' if graphs else 'off'}": _profile(
            model_1b(), arch, batches[0], prompt, graphs, generator) for graphs in (True, False)}

    def loops_fp32() -> dict:  # a small model beside the 1.1B one
        return _loops_agree_fp32(batches[0], prompt, new, generator)

    def decode_7b() -> dict:
        held.clear()
        _free()
        big_prompt, big_new = (256, 256) if ON_GPU else (8, 8)
        arch_7b = ArchSpec("7b", seq_length=big_prompt + big_new,
                           **(GPU_SHAPES["7b"] if ON_GPU else DRY_RUN_SHAPE))
        held["7b"] = _build(arch_7b, dtype, init=False)[0]
        copy = result["copy_GBps"] * 1e9 if isinstance(result.get("copy_GBps"), float) else None
        return _decode_figures(held["7b"], arch_7b, 64 if ON_GPU else 2, big_prompt, big_new,
                               True, copy, generator, repeats=1 if ON_GPU else 2)

    # the key figures first: a time limit cuts the rest
    parts = [("copy_GBps", copy_gbps), ("1.1b", decode_1b), ("1.1b_uneven", uneven),
             ("loops_fp32", loops_fp32), ("profile", profile), ("7b", decode_7b)]
    errors: list[str] = []
    for index, (name, measure) in enumerate(parts):
        try:
            result[name] = measure()
        except (Exception, _TimedOut) as error:  # noqa: BLE001 - each one reports for itself
            if not _SIGTERM:
                traceback.print_exc()
            result[name] = {"error": str(error) if _SIGTERM else
                            f"{type(error).__name__}: {error}"[:2000]}
            errors.append(name)
            if _SIGTERM:
                for later, _ in parts[index + 1:]:
                    result[later] = {"error": "not run: the part's time limit came first"}
                    errors.append(later)
                break
            held.clear()
            _free()
    if errors:
        result["errors"] = errors
    return result


def _free() -> None:
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


def _match(a, b) -> dict:
    """How two generate calls over the same prompts agree: ``token_match_fraction``, each row's
    responses' common prefix (the tokens drawn alike before any difference) over the longer
    response, summed over the rows; ``rows_equal_fraction``, rows whose responses are equal;
    ``max_logprob_diff``, the largest sampling log-prob difference on the common prefixes."""
    width = a.prompt_length
    tokens_a, tokens_b = a.input_ids[:, width:].cpu(), b.input_ids[:, width:].cpu()
    lp_a, lp_b = a.response_logprobs.float().cpu(), b.response_logprobs.float().cpu()
    common = total = equal_rows = 0
    max_diff = 0.0
    for row, (len_a, len_b) in enumerate(zip(a.response_lengths.tolist(),
                                             b.response_lengths.tolist(), strict=True)):
        n = min(len_a, len_b)
        differ = (tokens_a[row, :n] != tokens_b[row, :n]).nonzero()
        prefix = int(differ[0, 0]) if len(differ) else n
        common += prefix
        total += max(len_a, len_b)
        equal_rows += int(len_a == len_b and prefix == n)
        if prefix:
            max_diff = max(max_diff, float((lp_a[row, :prefix] - lp_b[row, :prefix]).abs().max()))
    return {"token_match_fraction": round(common / total, 4) if total else None,
            "rows_equal_fraction": round(equal_rows / len(tokens_a), 4),
            "max_logprob_diff": float(f"{max_diff:.3g}")}


def _uneven_answers(model, pgc, arch: ArchSpec, batch: int, prompt: int, new: int,
                    generator) -> dict:
    """Static against continuous batching (graphs as ``auto``), all prompts in one batch, when a
    tenth of the vocabulary ends an answer: the continuous loop's slots shrink as answers end
    (one capture per slot count). One warm-up and one timed call each; ``match`` says how far
    their tokens agree (bf16 on a GPU: the loops' rounding differs, so tokens may part; the fp32
    comparison is ``loops_fp32``)."""
    prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
    end_ids = list(range(arch.vocab_size - arch.vocab_size // 10, arch.vocab_size))
    result, outputs = {}, {}
    for batching in ("static", "continuous"):
        config = GenerationConfig(max_new_tokens=new, batching=batching, seed=1)
        _timed(model, pgc, prompts, config, end_ids)
        seconds, outputs[batching] = _timed(model, pgc, prompts, config, end_ids)
        tokens = int(outputs[batching].response_lengths.sum())
        result[batching] = {"seconds": round(seconds, 4), "tokens": tokens,
                            "tokens_per_s": round(tokens / seconds, 1)}
    result["slot_counts"] = [w.rows for w in outputs["continuous"].micro_batches
                             if w.decode_context]
    result["speedup"] = round(result["continuous"]["tokens_per_s"]
                              / result["static"]["tokens_per_s"], 2)
    result["match"] = _match(outputs["static"], outputs["continuous"])
    return result


def _loops_agree_fp32(batch: int, prompt: int, new: int, generator) -> dict:
    """Static and continuous batching (graphs as ``auto``) on the same prompts in fp32 (no TF32)
    on a small model with seeded weights, answers ended by a tenth of the vocabulary: both should
    draw the same tokens, their log-probs equal to rounding (``_match``'s figures)."""
    shape = LOOPS_SHAPE if ON_GPU else DRY_RUN_SHAPE
    arch = ArchSpec("loops", seq_length=prompt + new, **shape)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model, pgc = _build(arch, "float32")
        prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
        end_ids = list(range(arch.vocab_size - arch.vocab_size // 10, arch.vocab_size))
        outputs = {batching: _timed(model, pgc, prompts, GenerationConfig(
                       max_new_tokens=new, batching=batching, seed=1), end_ids)[1]
                   for batching in ("static", "continuous")}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return {"shape": shape, "batch": batch, "prompt": prompt, "new_tokens": new,
            "tokens": {name: int(out.response_lengths.sum()) for name, out in outputs.items()},
            **_match(outputs["static"], outputs["continuous"])}


def _profile(model, arch: ArchSpec, batch: int, prompt: int, graphs: bool, generator) -> dict:
    """Kernels, host ms and GPU busy share per decode step over 10 decode steps (the prefill and
    the graph capture before the profiler starts)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = torch.randint(0, arch.vocab_size, (batch, prompt), generator=generator).tolist()
    steps = 10
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    with cuda_redirect_suspended():
        decoding = _decoding(model, prompts, steps + 1, graphs)
        _sync()
        prof = profile(activities=activities)
        with prof:
            start = time.perf_counter()
            for _ in range(steps):
                decoding.run.step()
            _sync()
            seconds = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    host_us = sum(e.self_cpu_time_total for e in events)
    return {"steps": steps, "kernels_per_step": round(kernels / steps, 1),
            "host_ms_per_step": round(host_us / 1e3 / steps, 3),
            "wall_ms_per_step": round(seconds * 1e3 / steps, 3),
            "gpu_busy_share": round(gpu_us / (seconds * 1e6), 3) if ON_GPU else None}


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
    if args.gpu_check:
        signal.signal(signal.SIGTERM, _on_sigterm)
    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    if not args.gpu_check:
        with torch.no_grad():
            body = compare_loops(args)
    else:
        try:
            with torch.no_grad():
                body = gpu_check(args)
        except (Exception, _TimedOut) as error:  # noqa: BLE001 - the JSON line comes anyway
            traceback.print_exc()
            body = {"error": f"{type(error).__name__}: {error}"[:2000], "errors": ["gpu_check"]}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the figures are in: print them whole
    print(json.dumps({"benchmark": "rollouts_gpu_check" if args.gpu_check else "rollouts",
                      "torch": torch.__version__, "threads": torch.get_num_threads(), **body,
                      "total_s": round(time.perf_counter() - start, 1)}), flush=True)
    sys.exit(1 if body.get("errors") else 0)


if __name__ == "__main__":
    main()
