"""The configurations the placement paper ran: LLaMA 7B-65B on 1, 2, 4 and 16 nodes of eight
A100-80GB under each strategy, with its rollout shape (1,024 prompts of 256 tokens, 256 generated).
The planner's tests check every one of them and ``benchmarks/planner_at_scale.py`` tabulates them
(docs/planner.md)."""

from __future__ import annotations

from megatron_rlhf.planner.workload import RolloutSpec

PAPER_ROLLOUT = RolloutSpec(batch=1024, prompt_length=256, generation_length=256,
                            micro_batch_size=4)
PAPER_MODELS = ("llama-7b", "llama-13b", "llama-33b", "llama-65b")
PAPER_NODES = (1, 2, 4, 16)
PAPER_STRATEGIES = ("flattening", "interleaving", "interleaving2", "separation")
