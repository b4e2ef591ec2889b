"""How much of a policy's held-out rule score survives a tiny random change of its weights.

    # the SFT model of a pipeline run (its PPO configuration names it and the held-out prompts)
    python benchmarks/research/greedy_fragility.py --config RUN/ppo/config.yaml \\
        --noise 0.01 0.03 --draws 3
    # another actor checkpoint, e.g. PPO's last one
    python benchmarks/research/greedy_fragility.py --config RUN/ppo/config.yaml \\
        --ckpt CKPT/step_00000080/actor

One process loads the actor (any saved TP/PP) at TP=1 and answers the run's held-out prompts
greedily and by sampling at the run's temperature, as the PPO run's evaluation does: the same
prompts, generation settings, sampling noise and rule. (On the default pipeline run it prints
the report's scores to the last digit; a run that generates at TP > 1 rounds differently.) Then
it does the same for copies of the model whose every weight tensor ``w`` became
``w + noise * std(w) * N(0, 1)``, each copy with its own draw, and measures how far the change
moved the policy: the KL per answer of the copy to the original on the copy's sampled answers,
summed exactly over the vocabulary at each position.

Prints one JSON line per model: ``checkpoint``, ``noise`` (0 for the original), ``draw``,
``greedy_rule``, ``sampled_rule``, ``kl_per_answer``.

Why: the greedy score of a model whose next-token distributions are nearly flat over the right
words hangs on tiny margins between them, so it can fall under a change of the policy that PPO's
KL penalty would call negligible; the sampled score, an average over the distribution, does not.
docs/results/main-job-history.md uses this on the default run's SFT model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled

from megatron_rlhf.runtime.patches import add_warning_filters  # noqa: E402

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

import torch  # noqa: E402

from megatron_rlhf.builder.sources import resolve_sources  # noqa: E402
from megatron_rlhf.config.loader import ConfigError, load_config  # noqa: E402
from megatron_rlhf.config.ppo_run import RunConfig  # noqa: E402
from megatron_rlhf.engine.run.evaluation import EVAL_ID_OFFSET, MODES, answering_config  # noqa: E402
from megatron_rlhf.engine.run.runner import (  # noqa: E402
    load_eval_prompts,
    rule_reward_for,
    run_tokenizer,
)
from megatron_rlhf.generation.generate import GenerationOutput, generate_sequences  # noqa: E402
from megatron_rlhf.models.checkpoint import (  # noqa: E402
    load_model_checkpoint,
    read_checkpoint_info,
)
from megatron_rlhf.models.forward_backward import model_inputs  # noqa: E402
from megatron_rlhf.models.gpt import build_gpt_model  # noqa: E402
from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime  # noqa: E402
from megatron_rlhf.runtime.distributed import destroy_distributed  # noqa: E402
from megatron_rlhf.topology.groups import build_model_process_groups  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True,
                        help="the PPO run's configuration (tokenizer, held-out prompts, sampling)")
    parser.add_argument("--ckpt", type=Path,
                        help="actor checkpoint (default: the configuration's actor_checkpoint)")
    parser.add_argument("--noise", type=float, nargs="*", default=[0.01, 0.03],
                        help="relative noise levels: each weight gets noise x its tensor's std")
    parser.add_argument("--draws", type=int, default=3, help="noise draws per level")
    args = parser.parse_args(argv)
    if any(level <= 0 for level in args.noise) or args.draws < 1:
        parser.error(f"--noise levels must be > 0 and --draws >= 1 (got {args.noise}, "
                     f"{args.draws})")
    return args


def perturb_(model: torch.nn.Module, original: dict[str, torch.Tensor], noise: float,
             seed: int) -> None:
    """Set every parameter to ``original + noise * std(original) * N(0, 1)``, the normal draws
    from a CPU generator seeded with ``seed`` (the same on any device)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = original[name]
            draw = torch.randn(base.shape, generator=generator).to(base)
            param.copy_(base + noise * base.std() * draw)


def next_token_logprobs(model: torch.nn.Module, output: GenerationOutput,
                        temperature: float) -> torch.Tensor:
    """``[b, R, V]`` log-softmax at ``temperature``, over the real vocabulary, of the
    distribution each response position of ``output`` was drawn from (TP=1)."""
    batch = {"input_ids": output.input_ids, "attention_mask": output.attention_mask}
    with torch.no_grad():
        logits = model(*model_inputs(batch))
    p = output.prompt_length
    return torch.log_softmax(logits[:, p - 1:-1, :model.token_vocab_size].float() / temperature,
                             dim=-1)


def sequence_kl(model: torch.nn.Module, reference: torch.nn.Module, output: GenerationOutput,
                temperature: float) -> torch.Tensor:
    """``[b]`` KL of ``model`` to ``reference`` per answer: the exact KL of their next-token
    distributions, summed over each answer's positions (an estimate of the sequence KL with
    less variance than the log-ratio of the drawn tokens alone, and never below zero)."""
    own = next_token_logprobs(model, output, temperature)
    ref = next_token_logprobs(reference, output, temperature)
    per_token = (own.exp() * (own - ref)).sum(dim=-1)
    return (per_token * output.response_mask).sum(dim=1)


def measure(model: torch.nn.Module, pg_collection, reference: torch.nn.Module, config: RunConfig,
            prompts: list[list[int]], rule, eos_id: int, pad_id: int) -> dict[str, float]:
    """Held-out rule score of ``model`` in both modes, and the KL per answer of ``model`` to
    ``reference`` on its sampled answers."""
    ids = [EVAL_ID_OFFSET + i for i in range(len(prompts))]
    figures: dict[str, float] = {}
    for mode in MODES:
        output = generate_sequences(model, pg_collection, prompts, ids,
                                    answering_config(config.generation, mode), eos_id, pad_id)
        scores = [rule(prompt, response[mask.bool()].tolist()) for prompt, response, mask
                  in zip(prompts, output.responses, output.response_mask, strict=True)]
        figures[f"{mode}_rule"] = sum(scores) / len(scores)
        if mode == "sampled":
            kl = sequence_kl(model, reference, output, config.generation.temperature)
            figures["kl_per_answer"] = kl.mean().item()
    return figures


def _inputs(args: argparse.Namespace
            ) -> tuple[RunConfig, str, Any, Any, list[list[int]], Any]:
    """The configuration, checkpoint and its model description, tokenizer, held-out prompts and
    rule, checked before any process group exists.

    Raises:
        ConfigError, FileNotFoundError, ValueError: with the field or flag to fix.
    """
    config = load_config(RunConfig, str(args.config), [])
    checkpoint = str(args.ckpt or config.models.actor_checkpoint)
    if not checkpoint:
        raise ValueError("no checkpoint: pass --ckpt or use a configuration with "
                         "models.actor_checkpoint")
    description = read_checkpoint_info(checkpoint).model
    tokenizer = run_tokenizer(config, resolve_sources(config))
    prompts = load_eval_prompts(config, tokenizer)
    rule = rule_reward_for(config, tokenizer)
    if not prompts or rule is None:
        raise ValueError("the configuration has no held-out prompts or no rule: set "
                         "evaluation.paths and evaluation.num_prompts, and reward.rule")
    return config, checkpoint, description, tokenizer, prompts, rule


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config, checkpoint, description, tokenizer, prompts, rule = _inputs(args)
    except (ConfigError, FileNotFoundError, ValueError) as error:
        print(f"greedy_fragility: {error}", file=sys.stderr)
        return 2
    initialize_runtime(RuntimeConfig())
    try:
        pg_collection = build_model_process_groups(description.model_spec("actor", 1, 1))
        models = [build_gpt_model(description.arch, description.build_options(), pg_collection)
                  for _ in range(2)]
        for model in models:
            load_model_checkpoint(model, pg_collection, checkpoint)
            model.eval()
        reference, perturbed = models
        original = {name: p.detach().clone() for name, p in reference.named_parameters()}
        runs = [(0.0, 0)] + [(level, draw) for level in args.noise for draw in range(args.draws)]
        for seed, (noise, draw) in enumerate(runs):
            if noise:
                perturb_(perturbed, original, noise, seed)
            figures = measure(perturbed, pg_collection, reference, config, prompts, rule,
                              tokenizer.eos_id, tokenizer.pad_id)
            print(json.dumps({"checkpoint": checkpoint, "noise": noise, "draw": draw,
                              **{k: round(v, 4) for k, v in figures.items()}}), flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
