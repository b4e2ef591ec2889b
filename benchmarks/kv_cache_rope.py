"""KV-cached generation with RoPE applied once per key vs megatron's re-rotation of the cache.

    .venv/bin/python benchmarks/kv_cache_rope.py               # ppo_step's shape, 2 threads
    .venv/bin/python benchmarks/kv_cache_rope.py --threads 1 --rounds 10

One process, one model (the ``ppo_step.py`` default shape, fp32): ``generate_sequences`` of 32
prompts of 32 tokens, 32 new tokens, timed alternately with megatron's own ``SelfAttention``
(which caches keys before RoPE and rotates the whole cache every decode step) and with
``models.attention.CachedRopeSelfAttention`` (the model's spec: keys rotated once, before they
are cached). The two share the weights; the class of the attention modules is swapped between
calls, and every pair of calls must give bitwise the same tokens and log-probs. Alternating
within one process makes the ratio meaningful on a shared machine, where absolute times are not.
Prints one JSON line: wall and CPU seconds per call (median) of each, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.generation import _single_rank_groups  # noqa: E402
from benchmarks.ppo_step import SHAPES  # noqa: E402
from megatron_rlhf.generation import GenerationConfig, generate_sequences  # noqa: E402
from megatron_rlhf.models.attention import as_megatron_self_attention  # noqa: E402
from megatron_rlhf.topology.models import ArchSpec  # noqa: E402


def timed_generate(model, pgc, prompts: list[list[int]], config: GenerationConfig):
    """``(wall s, CPU s, output)`` of one ``generate_sequences`` call."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = generate_sequences(model, pgc, prompts, list(range(len(prompts))), config, None, 0)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=6, help="calls of each, alternating")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    arch = ArchSpec("ppo-step", **SHAPES["default"])
    pgc = _single_rank_groups()
    model = build_gpt_model(arch, ModelBuildOptions(params_dtype="float32"), pgc)
    init_weights(model, pgc, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, arch.vocab_size, (args.batch, args.prompt_length),
                            generator=generator).tolist()
    config = GenerationConfig(max_new_tokens=args.new_tokens, seed=1, stop_at_eos=False)
    timed_generate(model, pgc, prompts, config)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"megatron": [], "rope_once": []}
    for _ in range(args.rounds):
        with as_megatron_self_attention(model):
            *megatron, reference = timed_generate(model, pgc, prompts, config)
        *ours, out = timed_generate(model, pgc, prompts, config)
        if not (torch.equal(out.input_ids, reference.input_ids)
                and torch.equal(out.response_logprobs, reference.response_logprobs)):
            raise RuntimeError("the two attention paths gave different generations")
        times["megatron"].append(tuple(megatron))
        times["rope_once"].append(tuple(ours))
    medians = {name: {"wall_s": round(statistics.median(t[0] for t in runs), 4),
                      "cpu_s": round(statistics.median(t[1] for t in runs), 4)}
               for name, runs in times.items()}
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, **medians, "speedup": {
        kind: round(medians["megatron"][kind] / medians["rope_once"][kind], 3)
        for kind in ("wall_s", "cpu_s")}}))


if __name__ == "__main__":
    main()
