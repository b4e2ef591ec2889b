"""tools/greedy_fragility.py: its answers match a hand-written greedy decode, its KL matches the
generator's own log-probs, and its noise is the documented, seeded perturbation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.scripts import load_script

_EOS, _PAD = 2, 0


def _rule(prompt: list[int], response: list[int]) -> float:
    """Any function of the exact tokens will do: the test compares two decodes of one model."""
    return len(response) / 8 + sum(response) % 7 / 7


def _model(seed: int):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights
    from tests.model_fixtures import TINY_ARCH, whole_world_groups

    pgc = whole_world_groups(1, 1)
    model = build_gpt_model(TINY_ARCH, ModelBuildOptions(head="lm"), pgc)
    init_weights(model, pgc, seed=seed)
    return model.eval(), pgc


def _greedy_by_hand(model, pgc, prompt: list[int], max_new_tokens: int) -> list[int]:
    from megatron_rlhf.generation.forward import RecomputeNextTokenLogits

    next_logits = RecomputeNextTokenLogits(model, pgc, model.real_vocab_size, False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(next_logits(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).argmax())
            ids.append(token)
            if token == _EOS:
                break
    return ids[len(prompt):]


def _check_tool() -> dict:
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.evaluation import EVAL_ID_OFFSET, answering_config
    from megatron_rlhf.generation.generate import generate_sequences
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    tool = load_script("tools/greedy_fragility.py")
    config = RunConfig()
    config.generation = dataclasses.replace(config.generation, max_new_tokens=8)
    prompts = [[1, 5 + i, 9, 40 + 3 * i] for i in range(6)]
    model, pgc = _model(seed=3)
    figures = tool.measure(model, pgc, model, config, prompts, _rule, _EOS, _PAD)
    by_hand = [_rule(p, _greedy_by_hand(model, pgc, p, 8)) for p in prompts]

    # The recomputed log-probs of the sampled answers against the generator's own.
    sampled = generate_sequences(model, pgc, prompts,
                                 [EVAL_ID_OFFSET + i for i in range(len(prompts))],
                                 answering_config(config.generation, "sampled"), _EOS, _PAD)
    recomputed = tool.response_logprobs(model, pgc, sampled, config.generation.temperature)

    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    tool.perturb_(model, original, 0.05, seed=4)
    generator = torch.Generator().manual_seed(4)
    expected = {name: base + 0.05 * base.std() * torch.randn(base.shape, generator=generator)
                for name, base in original.items()}
    same_formula = all(torch.equal(p, expected[name]) for name, p in model.named_parameters())
    reference, _ = _model(seed=3)
    moved = tool.measure(model, pgc, reference, config, prompts, _rule, _EOS, _PAD)
    return {"figures": figures, "by_hand": sum(by_hand) / len(by_hand),
            # a float, not tensors: torch shares a returned tensor's memory with the parent
            "logprob_gap": (recomputed - sampled.response_policy_logprobs
                            * sampled.response_mask).abs().max().item(),
            "same_formula": same_formula, "moved": moved}


@pytest.mark.multirank
def test_tool_decodes_like_a_hand_loop_and_perturbs_as_documented() -> None:
    out = run_on_ranks(_check_tool, world_size=1, timeout_s=180)[0]
    assert out["figures"]["greedy_rule"] == pytest.approx(out["by_hand"], abs=1e-9)
    # The KV-cached generator and a full forward agree to rounding: no KL to itself.
    assert out["figures"]["kl_per_answer"] == pytest.approx(0.0, abs=1e-4)
    assert out["logprob_gap"] < 1e-4
    assert out["same_formula"]
    # A perturbed copy has moved from the original: a positive KL on its own sampled answers.
    assert out["moved"]["kl_per_answer"] > 1e-3


def test_bad_noise_levels_are_refused() -> None:
    tool = load_script("tools/greedy_fragility.py")
    for argv in (["--config", "c.yaml", "--noise", "0"], ["--config", "c.yaml", "--draws", "0"]):
        with pytest.raises(SystemExit):
            tool.parse_args(argv)
