"""Causal attention over packed sequences on this machine: which torch path is fastest.

    python benchmarks/packed_attention.py            # 8 sequences of 25-90 tokens, GQA 8/4

Compares, on the same queries, keys and values (fp32, one thread by default so that other work
on the machine disturbs the figures less): the padded batch as it ran before packing (SDPA with
the causal + padding float mask over ``[b, s]``), SDPA once per packed sequence with
``is_causal`` (``models.attention.packed_causal_attention``), one SDPA over the packed row with
a block-diagonal causal mask, and eager FlexAttention with a document-causal block mask. Prints
one JSON line: the best of ``--repeats`` milliseconds per call and each packed path's largest
difference from the per-sequence one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.models.attention import packed_causal_attention  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 70, 25, 90, 60, 33, 80, 50])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lengths = torch.tensor(args.lengths)
    total, longest, rows = int(lengths.sum()), int(lengths.max()), len(args.lengths)
    cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    q = torch.randn(total, args.heads, args.head_dim)
    k, v = (torch.randn(total, args.groups, args.head_dim) for _ in range(2))
    document = torch.repeat_interleave(torch.arange(rows), lengths)

    def per_sequence():
        return packed_causal_attention(q, k, v, cu_seqlens, longest, None)

    def block_diagonal():
        mask = (document[:, None] == document[None, :]) & torch.ones(
            total, total, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)),
                                             attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1).reshape(total, -1)

    def flex_eager():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def document_causal(b, h, q_idx, kv_idx):
            return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

        block = create_block_mask(document_causal, None, None, total, total, device="cpu")
        out = flex_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block,
                             enable_gqa=True)
        return out[0].transpose(0, 1).reshape(total, -1)

    columns = torch.arange(longest)
    valid = columns[None] < lengths[:, None]
    bias = torch.zeros(rows, 1, longest, longest).masked_fill(
        ~(valid[:, None, None, :] & torch.ones(longest, longest, dtype=torch.bool).tril()), -1e4)
    padded = [torch.randn(rows, n, longest, args.head_dim) for n in (args.heads, args.groups,
                                                                        args.groups)]

    def padded_masked():
        return F.scaled_dot_product_attention(*padded, attn_mask=bias, enable_gqa=True)

    reference = per_sequence()
    result = {"benchmark": "packed_attention", "torch": torch.__version__,
              "threads": args.threads, "lengths": args.lengths, "ms": {}, "max_abs_diff": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's advice to compile it
        for name, fn in (("padded_masked_sdpa", padded_masked), ("per_sequence_sdpa", per_sequence),
                         ("block_diagonal_sdpa", block_diagonal), ("flex_eager", flex_eager)):
            result["ms"][name] = round(best_ms(fn, args.repeats), 3)
            if name not in ("padded_masked_sdpa", "per_sequence_sdpa"):
                result["max_abs_diff"][name] = float((fn() - reference).abs().max())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
