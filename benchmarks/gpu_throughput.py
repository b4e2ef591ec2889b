"""bf16 training and decoding throughput of one ~1B Llama-shaped model on one GPU, with rooflines.

    python benchmarks/gpu_throughput.py                 # ~1.1B: 16 layers, hidden 2048, GQA 32/8
    python benchmarks/gpu_throughput.py --layers 4      # smaller, for a quick look

Without CUDA it runs the same code on the CPU in fp32 (give it a tiny shape: the test suite does,
so that the GPU check cannot fail on a typo); the memory figures are then absent.

Everything goes through the engine's own pieces: ``build_gpt_model`` (bf16, megatron's local
layer spec), ``ModelTrainer`` (megatron DDP + distributed optimizer, fp32 gradient reduction)
with ``run_microbatches``, and ``generate_sequences`` with megatron's static KV cache. In the same
process it measures the GPU's limits: a bf16 8192^3 matmul (FLOP/s) and a device-to-device copy
(bytes read + written per second). Prints one JSON line.

Model FLOP (Narayanan et al. 2021, counted as executed, causal attention as the full square):
    forward per token = 2 * N_matmul + 4 * L * s * h, training = 3 x forward,
where N_matmul counts the weights of every matrix product (attention, MLP, LM head; not the
embedding lookup), L layers, s the sequence length, h the hidden size. MFU = achieved / the
GPU's bf16 dense peak from its spec sheet; the measured matmul rate is reported beside it. Each
attention variant (``--attention``: ``packed``, SDPA over packed sequences, the default of every
run; ``sdpa`` and ``megatron``, the padded rows with an explicit mask) is measured on a fresh
model in the same process, so their ratio is not blurred by another run's conditions.

Decode memory traffic per step (a lower bound: weights once, the KV cache once):
    bytes = 2 * N_matmul + 2 (K and V) * L * b * kv_len * kv_heads * head_dim * 2
with kv_len the prompt plus the tokens generated so far (averaged over the steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.topology import flops  # noqa: E402

# Spec-sheet peaks of the GPUs the project has seen (dense bf16 FLOP/s, HBM bytes/s).
SPEC_PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--query-groups", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048, help="training sequence length")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="per optimizer step")
    parser.add_argument("--train-steps", type=int, default=3, help="timed, after one warm-up")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--attention", default="packed,sdpa",
                        help="attention variants to measure (packed, sdpa, megatron), each on a "
                             "fresh model")
    return parser.parse_args()


ON_GPU = torch.cuda.is_available()


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def timed(fn, repeats: int = 1) -> float:
    """Seconds per call of ``fn`` (the GPU synchronised at both ends)."""
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats


def measured_limits(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The device's matmul rate at a large square shape and its copy bandwidth."""
    n, copy_bytes = (8192, 2 * 2**30) if ON_GPU else (512, 2**26)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn_like(a)
    timed(lambda: a @ b, 3)
    matmul = 2 * n**3 / timed(lambda: a @ b, 20)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timed(lambda: dst.copy_(src), 3)
    copy = 2 * src.numel() / timed(lambda: dst.copy_(src), 20)
    return {"matmul_flops": matmul, "copy_bytes_per_s": copy}


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else None


def reset_peak() -> None:
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()


def measure(args: argparse.Namespace, arch, backend: str, device: torch.device,
            dtype: torch.dtype, limits: dict[str, float], spec: tuple) -> dict:
    """Training and decoding figures of one freshly built model with ``backend`` attention
    (``packed``: SDPA over packed sequences)."""
    from megatron_rlhf.generation import GenerationConfig, generate_sequences
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.topology.groups import build_model_process_groups
    from megatron_rlhf.topology.models import ModelSpec

    spec_flops, spec_bytes = spec
    pgc = build_model_process_groups(ModelSpec("actor", arch, trainable=True))
    reset_peak()
    options = ModelBuildOptions(params_dtype=str(dtype)[6:], packed_sequences=backend == "packed",
                                attention_backend="sdpa" if backend == "packed" else backend)
    model = build_gpt_model(arch, options, pgc)
    memory = {"weights_gib": peak_gib()}
    params = sum(p.numel() for p in model.parameters())
    trainer = ModelTrainer(model, pgc, OptimizerSettings(lr=1e-5))
    memory["weights_and_optimizer_gib"] = peak_gib()

    def loss_fn(output: torch.Tensor, batch: dict[str, torch.Tensor]):
        logprobs, _ = vocab_parallel_logprobs(output[:, :-1], batch["input_ids"][:, 1:], pgc.tp,
                                              args.vocab)
        tokens = torch.tensor(logprobs.numel(), device=device, dtype=torch.int)
        return -logprobs.sum(), tokens, {}

    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, args.vocab, (args.micro_batch, args.seq),
                                           generator=generator).to(device),
                "attention_mask": torch.ones(args.micro_batch, args.seq, dtype=torch.long,
                                             device=device)} for _ in range(args.micro_batches)]
    trainer.train_step(batches, loss_fn)
    reset_peak()
    train_s = timed(lambda: trainer.train_step(batches, loss_fn), args.train_steps)
    memory["train_peak_gib"] = peak_gib()
    tokens = args.micro_batch * args.micro_batches * args.seq
    n_matmul = flops.matmul_weights(arch)
    # every token attends the whole sequence, as executed
    train_flop = flops.TRAINING_PASSES * flops.forward_flops(arch, tokens, args.seq)

    prompts = torch.randint(0, args.vocab, (args.decode_batch, args.prompt),
                            generator=torch.Generator().manual_seed(1)).tolist()
    config = GenerationConfig(max_new_tokens=args.new_tokens, greedy=True, stop_at_eos=False,
                              stop_check_interval=args.new_tokens)

    def decode() -> None:
        generate_sequences(trainer.module, pgc, prompts, list(range(len(prompts))), config,
                           None, 0)

    decode()
    reset_peak()
    decode_s = timed(decode)
    memory["decode_peak_gib"] = peak_gib()
    head_dim = args.hidden // args.heads
    mean_kv = args.prompt + (args.new_tokens - 1) / 2
    kv_bytes = 2 * args.layers * args.decode_batch * mean_kv * args.query_groups * head_dim * 2
    step_bytes = 2 * n_matmul + kv_bytes
    steps_per_s = args.new_tokens / decode_s  # the prefill is included in the time: a bound
    return {
        "params": params,
        "train": {"tokens_per_step": tokens, "step_s": train_s, "tokens_per_s": tokens / train_s,
                  "tflops": train_flop / train_s / 1e12,
                  "mfu_spec": train_flop / train_s / spec_flops if spec_flops else None,
                  "fraction_of_measured_matmul": train_flop / train_s / limits["matmul_flops"]},
        "decode": {"batch": args.decode_batch, "prompt": args.prompt,
                   "new_tokens": args.new_tokens, "seconds": decode_s,
                   "tokens_per_s": args.decode_batch * args.new_tokens / decode_s,
                   "step_ms": 1e3 / steps_per_s,
                   "hbm_fraction_spec": step_bytes * steps_per_s / spec_bytes if spec_bytes
                   else None,
                   "fraction_of_measured_copy": step_bytes * steps_per_s
                   / limits["copy_bytes_per_s"]},
        "memory_gib": memory,
    }


def main() -> None:
    args = parse_args()
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.runtime.device import compute_device
    from megatron_rlhf.runtime.distributed import destroy_distributed
    from megatron_rlhf.topology.models import ArchSpec

    initialize_runtime()
    device = compute_device()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    limits = measured_limits(device, dtype)
    name = torch.cuda.get_device_name() if ON_GPU else "cpu"
    spec = next((v for k, v in SPEC_PEAKS.items() if k in name), (None, None))
    arch = ArchSpec("bench-1b", num_layers=args.layers, hidden_size=args.hidden,
                    num_attention_heads=args.heads, vocab_size=args.vocab,
                    seq_length=max(args.seq, args.prompt + args.new_tokens),
                    ffn_hidden_size=args.ffn, gated_mlp=True, num_query_groups=args.query_groups)
    runs = {}
    for backend in args.attention.split(","):
        runs[backend] = measure(args, arch, backend, device, dtype, limits, spec)
        if ON_GPU:
            torch.cuda.empty_cache()  # the previous model is gone once measure returns
    result = {
        "benchmark": "gpu_throughput", "device": name, "torch": torch.__version__,
        "params": runs[next(iter(runs))]["params"], "matmul_params": flops.matmul_weights(arch),
        "attention": runs,
        "limits": {"matmul_tflops": limits["matmul_flops"] / 1e12, "dtype": str(dtype),
                   "copy_tb_per_s": limits["copy_bytes_per_s"] / 1e12,
                   "spec_bf16_tflops": spec[0] / 1e12 if spec[0] else None,
                   "spec_hbm_tb_per_s": spec[1] / 1e12 if spec[1] else None},
    }
    print(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
