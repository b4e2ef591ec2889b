"""Per-stage peak memory of a flattening PPO run against the engine's prediction.

    python benchmarks/stage_memory.py                       # GPU check: ~1B Llama shape, bf16
    python benchmarks/stage_memory.py --layers 2 --hidden 64 --heads 4 --groups 2 --ffn 128 \\
        --vocab 256 --prompts 4 --prompt-length 8 --new-tokens 4    # tiny, on CPU

One process (a world of one), flattening, the four models resident (no offload), bf16 parameters,
every response ``--new-tokens`` long (``stop_at_eos=false``, so the KV cache is as long as the
prediction's). Two PPO steps run through ``PPOAlgorithm`` with the run's memory meter on; step
2's ``memory/<stage>_peak_bytes`` (on CUDA the allocator's peak over the stage; on CPU the model
state plus the KV cache the engine counts) is set against
``engine.run.stage_memory.stage_peaks`` over the planner's per-model bytes (state and KV cache:
no activations, logits or allocator slack, which is what the recorded GPU peak adds to it).
Prints one JSON line: per stage the recorded and predicted GiB and recorded / predicted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2.0**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.run.stage_memory import planner_role_bytes, stage_peaks
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.context import RunContext
    from megatron_rlhf.runtime.memory_meter import MemoryMeter
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.placement_config import PlacementConfig

    arch = {"num_layers": args.layers, "hidden_size": args.hidden,
            "num_attention_heads": args.heads, "num_query_groups": args.groups,
            "ffn_hidden_size": args.ffn, "vocab_size": args.vocab, "gated_mlp": True,
            "seq_length": args.prompt_length + args.new_tokens}
    config = RunConfig(
        placement=PlacementConfig(strategy="flattening"),
        models=ModelsConfig(arch=arch, init_seed=9, params_dtype="bfloat16"),
        rollout=RolloutConfig(prompts_per_step=args.prompts, max_prompt_length=args.prompt_length,
                              micro_batch_size=args.micro_batch),
        generation=GenerationConfig(max_new_tokens=args.new_tokens, seed=3, stop_at_eos=False),
        reward=RewardConfig(model_weight=1.0, rule="none"), steps=2)
    plan = make_plan(config, cluster_from_environment(None))
    engine = build_engine(config, plan, eos_id=3, pad_id=0,
                          context=RunContext(memory=MemoryMeter(enabled=True)))
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, args.vocab, (2 * args.prompts, args.prompt_length),
                            generator=generator).tolist()
    n = args.prompts
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                             prompts=lambda s: (prompts[n * s:n * (s + 1)],
                                                list(range(n * s, n * (s + 1)))),
                             total_steps=2)
    recorded = [algorithm.step(step) for step in range(2)][1]
    predicted = stage_peaks(plan, planner_role_bytes(plan, config), offloaded=())[0]
    stages = {}
    for stage, bytes_ in sorted(predicted.items()):
        got = recorded.get(f"memory/{stage}_peak_bytes")
        stages[stage] = {"recorded_gib": None if got is None else round(got / GIB, 4),
                         "predicted_gib": round(bytes_ / GIB, 4),
                         "recorded_over_predicted": None if got is None else round(
                             got / bytes_, 3)}
    return {"arch": arch, "prompts": args.prompts, "prompt_length": args.prompt_length,
            "new_tokens": args.new_tokens, "micro_batch": args.micro_batch, "stages": stages}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime

    start = time.perf_counter()
    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    body = measure(args)
    print(json.dumps({"benchmark": "stage_memory", "device": "cuda" if torch.cuda.is_available()
                      else "cpu", **body, "total_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
