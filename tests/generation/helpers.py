"""Shared helpers of the generation tests: prompts and tiny models with fixed weights."""

from __future__ import annotations

import torch

from megatron_rlhf.generation import GenerationConfig, GenerationOutput, generate_sequences
from tests.model_fixtures import TinyArch

INIT_SEED = 11


def make_prompts(lengths: list[int], seed: int = 0, vocab_size: int = 250) -> list[list[int]]:
    """Random prompts of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def build_tiny(head: str = "lm", tp: int = 1):
    """A TinyArch model over the whole world (DP = world / tp) with layout-independent weights.

    Returns:
        ``(model, pg_collection)``.
    """
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights
    from tests.model_fixtures import whole_world_groups

    pgc = whole_world_groups(tp, 1)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(head=head), pgc)
    init_weights(model, pgc, seed=INIT_SEED)
    return model, pgc


PAD = 0
SAMPLES = 2  # responses per prompt, as rollout.samples_per_prompt
BASE = GenerationConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=4,
                        greedy_every=SAMPLES)
EXACT = ("input_ids", "attention_mask", "prompt_mask", "response_mask", "prompt_lengths",
         "response_lengths")


def generate_tiny(tiny, config: GenerationConfig, eos_id, prompts=None) -> GenerationOutput:
    """Every test prompt twice (greedy, then sampled), through ``generate_sequences``."""
    model, pgc = tiny
    prompts = prompts or [p for p in make_prompts([4, 9, 2, 6, 11, 3, 5], seed=6)
                          for _ in range(SAMPLES)]
    return generate_sequences(model, pgc, prompts, list(range(30, 30 + len(prompts))), config,
                              eos_id=eos_id, pad_id=PAD)


def assert_same_samples(out: GenerationOutput, reference: GenerationOutput) -> None:
    """The same tokens and masks; log-probs within rounding."""
    for name in EXACT:
        assert torch.equal(getattr(out, name), getattr(reference, name)), name
    for name in ("response_logprobs", "response_policy_logprobs"):
        torch.testing.assert_close(getattr(out, name), getattr(reference, name), rtol=0,
                                   atol=1e-5)


def split_work(out: GenerationOutput) -> tuple[list, list]:
    """``out.micro_batches`` as (prefills, decode phases)."""
    return ([w for w in out.micro_batches if not w.decode_context],
            [w for w in out.micro_batches if w.decode_context])
