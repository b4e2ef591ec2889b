"""Which attention and sampling kernels the engine's hot paths get on this machine's torch.

    python benchmarks/gpu_kernels.py            # on a GPU: a 1B-class shape in bf16
    python benchmarks/gpu_kernels.py --tiny     # anywhere: tiny shapes (the CPU test runs this)

Prints one JSON line: the torch release and its varlen attention arguments (and which call the
packed training path makes of it), then milliseconds per call of: a GQA decode step's attention
as enable_gqa and as the folded call the engine makes, each also restricted to the
memory-efficient kernel (``null`` where that kernel refuses the call); packed causal attention
through varlen against the per-sequence loop; the token sampler's float64 inverse CDF against a
float32 one. A measurement that fails gives ``{"error": ...}`` and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _timed_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - start) / repeats * 1e3, 4)


def _measure(figures: dict, name: str, fn: Callable[[], object]) -> None:
    try:
        figures[name] = fn()
    except Exception as error:  # noqa: BLE001 - one failed figure must not hide the rest
        figures[name] = {"error": f"{type(error).__name__}: {error}"[:300]}


def _efficient_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])


def decode_attention(device, dtype, b, heads, groups, dim, keys) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(b, heads, 1, dim, device=device, dtype=dtype, generator=generator)
    key, value = (torch.randn(b, groups, keys, dim, device=device, dtype=dtype,
                              generator=generator) for _ in range(2))
    valid = torch.arange(keys, device=device) < torch.randint(
        keys // 2, keys + 1, (b, 1), device=device, generator=generator)
    bias = torch.zeros(b, 1, 1, keys, device=device, dtype=dtype).masked_fill_(
        ~valid[:, None, None, :], -10000.0)

    def gqa():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, enable_gqa=True)

    def folded():
        return F.scaled_dot_product_attention(
            query.reshape(b, groups, heads // groups, dim), key, value,
            attn_mask=bias).reshape(b, heads, 1, dim)

    result = {"max_abs_diff": float((gqa() - folded()).abs().max())}
    for name, fn in (("enable_gqa_ms", gqa), ("folded_ms", folded)):
        result[name] = _timed_ms(fn, device)
        try:
            with _efficient_only():
                result[name.replace("_ms", "_efficient_kernel_ms")] = _timed_ms(fn, device)
        except RuntimeError:
            result[name.replace("_ms", "_efficient_kernel_ms")] = None
    return result


def packed_attention(device, dtype, sequences, length, heads, groups, dim) -> dict:
    from megatron_rlhf.models.attention import _flash_varlen, packed_causal_attention

    tokens = sequences * length
    generator = torch.Generator(device=device).manual_seed(1)
    query = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=generator)
    key, value = (torch.randn(tokens, groups, dim, device=device, dtype=dtype,
                              generator=generator) for _ in range(2))
    cu_seqlens = torch.arange(0, tokens + 1, length, device=device, dtype=torch.int32)
    result = {"path": "varlen" if _flash_varlen() is not None else "per-sequence loop"}
    result["packed_ms"] = _timed_ms(
        lambda: packed_causal_attention(query, key, value, cu_seqlens, length, None), device)
    with _no_varlen():
        result["loop_ms"] = _timed_ms(
            lambda: packed_causal_attention(query, key, value, cu_seqlens, length, None), device)
    return result


@contextlib.contextmanager
def _no_varlen():
    import megatron_rlhf.models.attention as attention

    original = attention._flash_varlen
    attention._flash_varlen = lambda: None
    try:
        yield
    finally:
        attention._flash_varlen = original


def sampler(device, rows, vocab) -> dict:
    from megatron_rlhf.generation.sampling import inverse_cdf_sample

    generator = torch.Generator(device=device).manual_seed(2)
    logprobs = torch.randn(rows, vocab, device=device, generator=generator).log_softmax(-1)
    uniforms = torch.rand(rows, device=device, dtype=torch.float64, generator=generator)

    def float32_cdf():
        cdf = logprobs.exp().cumsum(dim=-1)
        target = (uniforms.float().unsqueeze(-1) * cdf[:, -1:])
        return torch.searchsorted(cdf, target, right=True)

    return {"float64_cdf_ms": _timed_ms(lambda: inverse_cdf_sample(logprobs, uniforms), device),
            "float32_cdf_ms": _timed_ms(float32_cdf, device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (any machine)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    figures: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()
                     if cuda else "cpu", "dtype": str(dtype).removeprefix("torch.")}
    try:
        from torch.nn.attention.varlen import varlen_attn

        figures["varlen_arguments"] = sorted(inspect.signature(varlen_attn).parameters)
    except ImportError:
        figures["varlen_arguments"] = None
    shape = (dict(b=64, heads=32, groups=8, dim=64, keys=1024) if cuda
             else dict(b=2, heads=4, groups=2, dim=8, keys=16))
    _measure(figures, "decode_attention", lambda: decode_attention(device, dtype, **shape))
    packed = (dict(sequences=32, length=256, heads=32, groups=8, dim=64) if cuda
              else dict(sequences=3, length=8, heads=4, groups=2, dim=8))
    _measure(figures, "packed_attention", lambda: packed_attention(device, dtype, **packed))
    for vocab in ((32000, 152064) if cuda else (64,)):
        _measure(figures, f"sampler_vocab_{vocab}",
                 lambda vocab=vocab: sampler(device, 256 if cuda else 4, vocab))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
