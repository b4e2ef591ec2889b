"""benchmarks/research/greedy_fragility.py: its greedy and sampled answers are the evaluation's,
its KL per answer matches a prefix-by-prefix computation, and its noise is the documented, seeded
draw."""

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


def _next_logprobs(model, pgc, ids: list[int], temperature: float) -> torch.Tensor:
    """Log-softmax of the next token after the unpadded ``ids``, by a full forward."""
    from megatron_rlhf.generation.forward import RecomputeNextTokenLogits

    next_logits = RecomputeNextTokenLogits(model, pgc, model.real_vocab_size, False)
    with torch.no_grad():
        logits = next_logits(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return torch.log_softmax(logits[0] / temperature, dim=-1)


def _greedy_by_hand(model, pgc, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(_next_logprobs(model, pgc, ids, 1.0).argmax()))
        if ids[-1] == _EOS:
            break
    return ids[len(prompt):]


def _kl_by_hand(model, reference, pgc, prompt: list[int], response: list[int],
                temperature: float) -> float:
    """KL of ``model`` to ``reference`` summed over the answer's positions, one prefix at a
    time."""
    total = 0.0
    for t in range(len(response)):
        prefix = prompt + response[:t]
        own = _next_logprobs(model, pgc, prefix, temperature)
        ref = _next_logprobs(reference, pgc, prefix, temperature)
        total += float((own.exp() * (own - ref)).sum())
    return total


def _answers(output) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(output.responses,
                                                          output.response_mask, strict=True)]


def _check_tool() -> dict:
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.evaluation import EVAL_ID_OFFSET, answering_config
    from megatron_rlhf.generation.generate import generate_sequences
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    tool = load_script("benchmarks/research/greedy_fragility.py")
    config = RunConfig()
    config.generation = dataclasses.replace(config.generation, max_new_tokens=8,
                                            temperature=0.8)
    temperature = config.generation.temperature
    # Prompts of 2 to 4 tokens: the batch is left-padded.
    prompts = [[1, 5 + i, 9, 40 + 3 * i][:2 + i % 3] for i in range(6)]
    model, pgc = _model(seed=3)
    figures = tool.measure(model, pgc, model, config, prompts, _rule, _EOS, _PAD)
    greedy_by_hand = [_rule(p, _greedy_by_hand(model, pgc, p, 8)) for p in prompts]
    # What the run's evaluation samples: its configuration and its prompt ids.
    ids = [EVAL_ID_OFFSET + i for i in range(len(prompts))]
    sampled = generate_sequences(model, pgc, prompts, ids,
                                 answering_config(config.generation, "sampled"), _EOS, _PAD)
    sampled_rule = [_rule(p, a) for p, a in zip(prompts, _answers(sampled), strict=True)]
    recomputed = tool.next_token_logprobs(model, sampled, temperature).gather(
        -1, sampled.responses[..., None])[..., 0] * sampled.response_mask

    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    tool.perturb_(model, original, 0.3, seed=4)
    generator = torch.Generator().manual_seed(4)
    expected = {name: base + 0.3 * base.std() * torch.randn(base.shape, generator=generator)
                for name, base in original.items()}
    same_formula = all(torch.equal(p, expected[name]) for name, p in model.named_parameters())
    reference, _ = _model(seed=3)
    moved = tool.measure(model, pgc, reference, config, prompts, _rule, _EOS, _PAD)
    moved_output = generate_sequences(model, pgc, prompts, ids,
                                      answering_config(config.generation, "sampled"), _EOS, _PAD)
    kl_by_hand = [_kl_by_hand(model, reference, pgc, p, a, temperature)
                  for p, a in zip(prompts, _answers(moved_output), strict=True)]
    # floats and lists, not tensors: torch shares a returned tensor's memory with the parent
    return {"figures": figures, "greedy_by_hand": sum(greedy_by_hand) / len(prompts),
            "sampled_by_hand": sum(sampled_rule) / len(prompts),
            "logprob_gap": (recomputed - sampled.response_policy_logprobs
                            * sampled.response_mask).abs().max().item(),
            "same_formula": same_formula, "moved": moved,
            "kl_rows": tool.sequence_kl(model, reference, moved_output, temperature).tolist(),
            "kl_by_hand": kl_by_hand}


@pytest.mark.multirank
def test_tool_decodes_and_measures_kl_like_hand_loops() -> None:
    out = run_on_ranks(_check_tool, world_size=1, timeout_s=180)[0]
    figures = out["figures"]
    assert figures["greedy_rule"] == pytest.approx(out["greedy_by_hand"], abs=1e-9)
    assert figures["sampled_rule"] == pytest.approx(out["sampled_by_hand"], abs=1e-9)
    # The model is its own reference: one function, one model, one batch (same kernels and
    # shapes), so the two log-prob tensors are the same bits and the KL is exactly zero.
    assert figures["kl_per_answer"] == 0.0
    # The tool's next-token distributions score each drawn token as the generator did.
    assert out["logprob_gap"] < 1e-4
    assert out["same_formula"]
    # A perturbed copy: its KL per answer, padded batch against one prefix at a time.
    assert out["kl_rows"] == pytest.approx(out["kl_by_hand"], rel=1e-3, abs=1e-5)
    assert min(out["kl_by_hand"]) > 0
    assert out["moved"]["kl_per_answer"] == pytest.approx(
        sum(out["kl_by_hand"]) / len(out["kl_by_hand"]), rel=1e-3)


def test_bad_noise_levels_are_refused(capsys) -> None:
    """A usage error (exit code 2) that names the bad values, not any other exit."""
    tool = load_script("benchmarks/research/greedy_fragility.py")
    for argv, shown in ((["--config", "c.yaml", "--noise", "0"], "got [0.0], 3"),
                        (["--config", "c.yaml", "--noise", "0.01", "-0.5"], "got [0.01, -0.5], 3"),
                        (["--config", "c.yaml", "--draws", "0"], "got [0.01, 0.03], 0")):
        with pytest.raises(SystemExit) as exit_info:
            tool.parse_args(argv)
        assert exit_info.value.code == 2, argv
        error = capsys.readouterr().err
        assert "--noise levels must be > 0 and --draws >= 1" in error and shown in error, error
    assert tool.parse_args(["--config", "c.yaml", "--noise", "0.02", "--draws", "1"]).draws == 1


def test_missing_inputs_are_refused_before_any_process_group(tmp_path, capsys) -> None:
    import torch.distributed as dist

    tool = load_script("benchmarks/research/greedy_fragility.py")
    config = tmp_path / "ppo.yaml"
    config.write_text("steps: 1\n")
    assert tool.main(["--config", str(config)]) == 2
    assert "pass --ckpt or use a configuration with models.actor_checkpoint" in (
        capsys.readouterr().err)
    missing = tmp_path / "no_such_checkpoint"
    assert tool.main(["--config", str(config), "--ckpt", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert tool.main(["--config", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err
    assert not dist.is_initialized()
