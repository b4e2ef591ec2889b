"""A whole PPO run: config -> tokenizer and prompts -> plan -> engine -> steps -> metrics.

Everything that can be refused (config values, placement, data) is checked before the first
process group is created.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.config.loader import to_yaml
from megatron_rlhf.data import DataConfig, generate_records, load_splits, rule_score
from megatron_rlhf.data.prompts import PromptStream
from megatron_rlhf.engine.build import build_engine, cluster_from_environment, make_plan
from megatron_rlhf.engine.config import RunConfig
from megatron_rlhf.engine.engine import RuleReward
from megatron_rlhf.engine.ppo import PPOTrainer
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.runtime.bootstrap import initialize_runtime
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.metrics import MetricsWriter
from megatron_rlhf.runtime.tracing import configure_tracing, write_chrome_trace
from megatron_rlhf.topology.models import arch_preset

logger = get_logger(__name__)


def load_prompts(config: RunConfig, tokenizer: Tokenizer) -> PromptStream:
    """Tokenised PPO prompts from the configured files, or the synthetic task."""
    if config.prompts.paths:
        data = DataConfig(list(config.prompts.paths), config.prompts.reader, config.prompts.split)
        splits, summaries = load_splits(data, tokenizer)
        for summary in summaries:
            logger.info("%s", summary.format())
        texts = [record.prompt for record in splits.ppo]
    else:
        texts = [record["prompt"] for record in generate_records(config.prompts.synthetic)]
    limit = config.rollout.max_prompt_length
    prompts = [tokenizer.encode(text, add_bos=True) for text in texts]
    too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts are longer than rollout.max_prompt_length="
                         f"{limit} tokens (first: #{too_long[0]}, {len(prompts[too_long[0]])} "
                         "tokens); raise the limit or set prompts.reader.max_prompt_tokens")
    return PromptStream(prompts, config.rollout.prompts_per_step, config.runtime.seed)


def rule_reward_for(config: RunConfig, tokenizer: Tokenizer) -> RuleReward | None:
    """The configured rule-based reward on decoded text, or None."""
    if config.reward.rule == "none":
        return None
    return lambda prompt, response: rule_score(tokenizer.decode(prompt), tokenizer.decode(response))


def run_ppo(config: RunConfig) -> Path:
    """Run PPO as configured; returns the run directory. Every rank calls it."""
    tokenizer = Tokenizer.from_config(config.tokenizer)
    arch = arch_preset(config.models.arch)
    if tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces but models.arch="
                         f"{arch.name!r} embeds {arch.vocab_size}; use a smaller tokenizer "
                         "vocab_size or a larger architecture")
    prompts = load_prompts(config, tokenizer)
    plan = make_plan(config, cluster_from_environment(config.cluster.pools))
    initialize_runtime(config.runtime)
    run_dir = Path(config.run_dir)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))
        (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    engine = build_engine(config, plan, tokenizer.eos_id, tokenizer.pad_id)
    tracer = configure_tracing(config.trace)
    trainer = PPOTrainer(engine, config.algorithm, config.rollout, config.reward,
                         config.runtime.seed, prompts.batch, config.steps,
                         rule_reward_for(config, tokenizer))
    writer = MetricsWriter(run_dir, config.steps)
    try:
        for step in range(config.steps):
            start = time.perf_counter()
            metrics = trainer.step(step)
            seconds = time.perf_counter() - start
            metrics.update(step_seconds=seconds,
                           samples_per_s=config.rollout.prompts_per_step / seconds)
            writer.write(step, metrics)
    finally:
        writer.close()
    if config.trace:
        write_chrome_trace(tracer, run_dir / "timeline.json")
    return run_dir
