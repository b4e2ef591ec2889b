"""Generation throughput with and without the KV cache, and the decode step's memory bandwidth.

    .venv/bin/python benchmarks/generation.py           # full run, under 5 minutes on 2 cores
    .venv/bin/python benchmarks/generation.py --quick   # a few seconds, smaller numbers

One process (a gloo world of one via ``initialize_runtime``), TP=1, float32, sampling at
temperature 1 with ``stop_at_eos=False`` so every response has the full length. Prints one JSON
line:

* ``<config>.kv_cache_tokens_per_s`` / ``no_cache_tokens_per_s``: generated tokens per second of
  ``generate_sequences`` (prefill included) with megatron's static KV cache and with full
  recomputation every step. Recomputation grows quadratically with the length, so at the larger
  config it runs ``no_cache_new_tokens`` tokens and the cached path is timed at that length too
  (``kv_cache_tokens_per_s_same_length``).
* ``decode_step_ms``: (time for N tokens - time for 1 token) / (N - 1): one cached decode step,
  sampling included.
* ``decode_bytes_per_step``: weights read by a decode step (every parameter except the input
  embedding table, of which only ``batch`` rows are read) plus the KV cache read at the mean
  cached length; ``decode_bandwidth_GBps`` divides it by the step time.
* ``decode_matmul_GFLOPs``: 2 x those weights x batch / step time, the weight matmuls' rate
  (attention over the cache not counted); at batch 32 a CPU decode step is compute-bound.
* ``copy_bandwidth_GBps``: bytes read + bytes written per second of a 256 MiB tensor copy, the
  machine's attainable memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from megatron_rlhf.topology.models import ArchSpec


@dataclass
class BenchCase:
    """One measured configuration."""

    name: str
    arch: ArchSpec
    batch: int
    prompt_len: int
    new_tokens: int
    no_cache_new_tokens: int
    repeats: int


TINY = ArchSpec("tiny-bench", num_layers=4, hidden_size=64, num_attention_heads=4,
                num_query_groups=2, ffn_hidden_size=128, vocab_size=250, seq_length=64,
                gated_mlp=True)
LARGER = ArchSpec("larger-bench", num_layers=8, hidden_size=512, num_attention_heads=8,
                  num_query_groups=4, ffn_hidden_size=1408, vocab_size=8192, seq_length=256,
                  gated_mlp=True)


def _cases(quick: bool) -> list[BenchCase]:
    if quick:
        return [BenchCase("tiny", TINY, 4, 8, 8, 8, 1), BenchCase("larger", LARGER, 4, 16, 8, 4, 1)]
    return [BenchCase("tiny", TINY, 8, 16, 48, 48, 5),
            BenchCase("larger", LARGER, 32, 64, 128, 16, 2)]


def copy_bandwidth_gbps(mebibytes: int = 256, repeats: int = 5) -> float:
    """Best (read + write) bandwidth of ``dst.copy_(src)`` over ``repeats`` copies, in GB/s."""
    src = torch.ones(mebibytes * 2**18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def _best_time(model, pgc, prompts, new_tokens: int, use_kv_cache: bool, repeats: int) -> float:
    """Fastest of ``repeats`` ``generate_sequences`` calls, in seconds (the machine is shared)."""
    from megatron_rlhf.generation import GenerationConfig, generate_sequences

    config = GenerationConfig(max_new_tokens=new_tokens, seed=1, stop_at_eos=False,
                              use_kv_cache=use_kv_cache)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate_sequences(model, pgc, prompts, list(range(len(prompts))), config, None, 0)
        best = min(best, time.perf_counter() - start)
        if out.response_lengths.min().item() != new_tokens:
            raise RuntimeError(f"expected {new_tokens} tokens per prompt, "
                               f"got {out.response_lengths.tolist()}")
    return best


def _matmul_params(model) -> int:
    """Parameters a decode step multiplies with (all but the input embedding table)."""
    return sum(p.numel() for n, p in model.named_parameters() if "word_embeddings" not in n)


def _decode_bytes(model, case: BenchCase) -> int:
    """Weights plus mean KV cache read by one decode step (see the module docstring)."""
    arch = case.arch
    weight_bytes = _matmul_params(model) * 4 + case.batch * arch.hidden_size * 4
    head_dim = arch.hidden_size // arch.num_attention_heads
    mean_kv_len = case.prompt_len + case.new_tokens / 2
    kv_bytes = 2 * arch.num_layers * case.batch * mean_kv_len * arch.num_query_groups * head_dim * 4
    return int(weight_bytes + kv_bytes)


def _single_rank_groups():
    """Process groups of a TP=1, PP=1 model in a world of one."""
    import torch.distributed as dist
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "dp", "pp"])
    pgs = {name: grid.create_pg(dims) for name, dims in {
        "tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "tp_cp": ["tp", "cp"],
        "dp_cp": ["cp", "dp"], "mp": ["tp", "pp"]}.items()}
    pgs["embd"] = pgs["pos_embd"] = dist.new_group([0])
    # A dense model is a single expert: expert parallelism of size 1 (topology.groups).
    pgs.update(ep=pgs["cp"], expt_tp=pgs["tp"], tp_ep=pgs["tp"], tp_ep_pp=pgs["mp"],
               expt_dp=pgs["dp"], intra_expt_dp=pgs["dp"])
    return ProcessGroupCollection(**pgs)


def run_case(case: BenchCase) -> dict:
    """Measure one configuration; returns its JSON fields."""
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights

    pgc = _single_rank_groups()
    model = build_gpt_model(case.arch, ModelBuildOptions(), pgc)
    init_weights(model, pgc, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, case.arch.vocab_size, (case.batch, case.prompt_len),
                            generator=generator).tolist()
    tokens = case.batch * case.new_tokens
    repeats = case.repeats
    _best_time(model, pgc, prompts, 2, True, repeats=1)  # warm-up
    one = _best_time(model, pgc, prompts, 1, True, repeats)
    full = _best_time(model, pgc, prompts, case.new_tokens, True, repeats)
    step_s = (full - one) / (case.new_tokens - 1)
    short = case.no_cache_new_tokens
    no_cache = _best_time(model, pgc, prompts, short, False, repeats)
    bytes_per_step = _decode_bytes(model, case)
    fields = {
        "params": sum(p.numel() for p in model.parameters()),
        "batch": case.batch, "prompt_len": case.prompt_len, "new_tokens": case.new_tokens,
        "kv_cache_tokens_per_s": round(tokens / full, 1),
        "no_cache_new_tokens": short,
        "no_cache_tokens_per_s": round(case.batch * short / no_cache, 1),
        "decode_step_ms": round(step_s * 1e3, 2),
        "decode_bytes_per_step": bytes_per_step,
        "decode_bandwidth_GBps": round(bytes_per_step / step_s / 1e9, 2),
        "decode_matmul_GFLOPs": round(2 * _matmul_params(model) * case.batch / step_s / 1e9, 1),
    }
    if short != case.new_tokens:
        same = _best_time(model, pgc, prompts, short, True, repeats)
        fields["kv_cache_tokens_per_s_same_length"] = round(case.batch * short / same, 1)
    arch = {k: v for k, v in asdict(case.arch).items() if k not in ("name", "gated_mlp")}
    return {**arch, **fields}


def main() -> None:
    """Run every case and print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke-test sizes")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    start = time.perf_counter()
    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    result: dict = {"benchmark": "generation", "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "copy_bandwidth_GBps": round(copy_bandwidth_gbps(), 2)}
    for case in _cases(args.quick):
        result[case.name] = run_case(case)
        result[case.name]["decode_bandwidth_fraction_of_copy"] = round(
            result[case.name]["decode_bandwidth_GBps"] / result["copy_bandwidth_GBps"], 3)
    result["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
