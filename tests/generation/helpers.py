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
BASE = GenerationConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=16,
                        greedy_every=SAMPLES)
EXACT = ("input_ids", "attention_mask", "prompt_mask", "response_mask", "prompt_lengths",
         "response_lengths")


def build_refit_models(count: int = 3) -> list:
    """``count`` tiny models: the first to generate with, the others (other initial weights) to
    refit it from."""
    from megatron_rlhf.models.weights import init_weights

    built = [build_tiny() for _ in range(count)]
    for offset, (model, pgc) in enumerate(built[1:], start=1):
        init_weights(model, pgc, seed=INIT_SEED + offset)
    return built


def generate_tiny(tiny, config: GenerationConfig, eos_id, prompts=None) -> GenerationOutput:
    """Every test prompt twice (greedy, then sampled), through ``generate_sequences``."""
    model, pgc = tiny
    prompts = prompts or [p for p in make_prompts([4, 9, 2, 6, 11, 3, 5], seed=6)
                          for _ in range(SAMPLES)]
    return generate_sequences(model, pgc, prompts, list(range(30, 30 + len(prompts))), config,
                              eos_id=eos_id, pad_id=PAD)


def assert_same_samples(out: GenerationOutput, reference: GenerationOutput) -> None:
    """The same tokens and masks; log-probs within rounding. The tokens of two decode paths are
    equal only when the reference's decisions are clear of a tie (:func:`decision_margin`)."""
    for name in EXACT:
        assert torch.equal(getattr(out, name), getattr(reference, name)), name
    for name in ("response_logprobs", "response_policy_logprobs"):
        torch.testing.assert_close(getattr(out, name), getattr(reference, name), rtol=0,
                                   atol=1e-5)


def split_work(out: GenerationOutput) -> tuple[list, list]:
    """``out.micro_batches`` as (prefills, decode phases)."""
    return ([w for w in out.micro_batches if not w.decode_context],
            [w for w in out.micro_batches if w.decode_context])


MIN_MARGIN = 1e-5
"""The closest token decision a test that compares the tokens of two decode paths may rely on.
The paths run other batch shapes, padding or kernels, whose fp32 rounding (and a CPU's choice of
kernel per shape: AVX-512, AVX2, NEON) moves the tiny model's logits by about 2e-7 and its
log-probs by about 1e-6; a decision closer than this to its tie may flip on another CPU. The
tiny model's distributions are nearly flat (250 tokens, logit spread about 1), so a long sampled
decode has decisions within 1e-6 of a tie for some seeds: the tests pick seeds clear of it."""


def decision_margin(tiny, out: GenerationOutput, config: GenerationConfig,
                    indices: list[int]) -> float:
    """How far the closest token decision of ``out`` is from flipping, recomputed by one full
    forward: for a greedy row the gap between the two best logits, for a sampled row the
    distance of its uniform from the ends of the drawn token's cumulative-probability interval
    (and, with top-k or top-p, of the filter's cut from its threshold).

    Two decode paths whose logits differ by rounding ``d`` draw the same tokens when this is
    well above it (a logit error ``d`` moves a logit gap by at most ``2 d`` and a cumulative
    probability by at most about ``2 d``); near a tie they may not, on some CPU. A decode that
    stops early makes a subset of the decisions of the same decode run to the end.

    Args:
        tiny: ``(model, pg_collection)`` that generated ``out``.
        out: the reference decode.
        config: its sampler settings (greedy, greedy_every, temperature, top-k, top-p, seed).
        indices: its prompt indices, which key the uniforms and ``greedy_every``.
    """
    from megatron_rlhf.generation.sampling import (
        greedy_row_mask,
        sampling_logprobs,
        sampling_uniform,
        top_k_top_p_keep,
    )
    from tests.helpers.models import full_logits

    model, pgc = tiny
    with torch.no_grad():
        logits = full_logits(model.eval(), pgc, {"input_ids": out.input_ids,
                                                 "attention_mask": out.attention_mask})
    start, width = out.prompt_length - 1, out.response_mask.shape[1]
    logits = logits[:, start:start + width, :model.real_vocab_size].double()  # no value channel
    greedy = greedy_row_mask(indices, config)
    margins = []
    for row, index in enumerate(indices):
        for t in range(int(out.response_mask[row].sum())):
            step = logits[row, t]
            if config.greedy or (greedy is not None and bool(greedy[row])):
                top = step.topk(2).values
                margins.append(float(top[0] - top[1]))
                continue
            dist = sampling_logprobs(step[None].float(), config.temperature, config.top_k,
                                     config.top_p)[0]
            cdf = dist.double().exp().cumsum(0)
            target = sampling_uniform(config.seed, index, t) * float(cdf[-1])
            token = int(out.responses[row, t])
            low = float(cdf[token - 1]) if token else 0.0
            margins.append(min(target - low, float(cdf[token]) - target))
            scaled = step / config.temperature
            ordered = scaled.sort(descending=True).values
            if config.top_k > 0:
                margins.append(float(ordered[config.top_k - 1] - ordered[config.top_k]))
            if config.top_p < 1.0:
                probs = ordered.softmax(0)
                keep = top_k_top_p_keep(probs, config.top_k, 1.0)
                probs = (probs * keep) / (probs * keep).sum()
                before = probs.cumsum(0) - probs
                margins.append(float((before[keep] - config.top_p).abs().min()))
    return min(margins)
