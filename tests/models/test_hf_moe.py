"""Hugging Face Qwen3-MoE and Mixtral (LM and sequence-classification) <-> megatron's MoE layers:
converted models give transformers' outputs (at TP=1 and, experts split, TP=2), both top-k
weightings of Qwen3-MoE included; HF -> megatron checkpoint -> HF writes the same safetensors
bytes, which transformers loads to the same outputs; configurations no megatron layer computes
are refused by field. A run started from a Qwen3-MoE or Mixtral directory reads its experts from
it into ``models.moe`` (a conflicting setting is refused), loads them split over two
expert-parallel ranks (the reference gives transformers' outputs) and trains them with GRPO."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers.models import assert_hf_mapping_round_trips, full_logits
from tests.helpers.runs import capture_engine
from tests.model_fixtures import whole_world_groups
from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_hf_model

_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
_SIZES = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
          "initializer_range": 0.1, "pad_token_id": 0, "num_experts_per_tok": 2}
# name -> (config class, model class, config fields beyond _SIZES)
_CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "moe_intermediate_size": 32, "intermediate_size": 96,
                   "norm_topk_prob": True, "head_dim": 24, "rope_theta": 1000000.0}),
    "qwen3_moe-softmax": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                          {"num_experts": 4, "moe_intermediate_size": 48,
                           "norm_topk_prob": False, "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 8, "intermediate_size": 32}),
    "mixtral-rm": ("MixtralConfig", "MixtralForSequenceClassification",
                   {"num_local_experts": 4, "intermediate_size": 32, "num_labels": 1}),
}


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    """Logits ``[b, s, vocab]``, or a classifier's score at every position ``[b, s, 1]``."""
    with torch.no_grad():
        if hasattr(model, "score"):
            return model.score(model.model(input_ids=_batch()["input_ids"]).last_hidden_state)
        return model(input_ids=_batch()["input_ids"]).logits


def _make(directory: Path, case: str) -> torch.Tensor:
    """Save a random tiny model of ``case`` to ``directory``; return its outputs."""
    config_cls, model_cls, extra = _CASES[case]
    return _outputs(make_hf_model(directory, config_cls, model_cls, len(case), **_SIZES,
                                  **extra))


def _convert_check_export(hf_dir: str, expected: torch.Tensor, out: str) -> None:
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.models.hf_llama import hf_to_full_state, load_hf_state
    from megatron_rlhf.models.weights import load_full_state
    from tools import convert_hf_to_megatron, convert_megatron_to_hf

    convert_hf_to_megatron.main(["--hf-dir", hf_dir, "--out", f"{out}/ckpt"])
    description = read_checkpoint_info(f"{out}/ckpt").model
    assert description.arch.experts.num_experts == _CASES[Path(hf_dir).name][2].get(
        "num_experts", _CASES[Path(hf_dir).name][2].get("num_local_experts"))
    pgc = whole_world_groups(1, 1)
    model = build_gpt_model(description.arch, description.build_options(), pgc)
    load_model_checkpoint(model, pgc, f"{out}/ckpt")
    torch.testing.assert_close(full_logits(model, pgc, _batch()), expected, **_TOLERANCE,
                               msg=lambda m: f"{hf_dir}: {m}")
    # the other top-k weighting computes something else: the comparison sees the router's
    experts = description.arch.experts
    other = replace(description, arch=replace(description.arch, experts=replace(
        experts, renormalize_topk=not experts.renormalize_topk)))
    model = build_gpt_model(other.arch, other.build_options(), pgc)
    load_full_state(model, pgc, hf_to_full_state(load_hf_state(hf_dir), description))
    assert (full_logits(model, pgc, _batch()) - expected).abs().max() > 1e-3, hf_dir
    convert_megatron_to_hf.main(["--ckpt", f"{out}/ckpt", "--out", f"{out}/hf"])


def _job(cases: list[tuple[str, torch.Tensor, str]]) -> None:
    for case in cases:
        _convert_check_export(*case)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_outputs_match_transformers_and_round_trip_is_bit_exact(tmp_path: Path) -> None:
    import transformers

    cases = [(str(tmp_path / name), _make(tmp_path / name, name), str(tmp_path / f"out_{name}"))
             for name in _CASES]
    run_on_ranks(_job, world_size=1, args=(cases,), timeout_s=240)
    for hf_dir, expected, out in cases:
        original, exported = Path(hf_dir) / "model.safetensors", Path(out) / "hf/model.safetensors"
        assert exported.read_bytes() == original.read_bytes(), hf_dir
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])
        reloaded = cls.from_pretrained(Path(out) / "hf").eval()
        assert torch.equal(_outputs(reloaded), expected), hf_dir
        for field in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "intermediate_size",
                      "moe_intermediate_size", "tie_word_embeddings", "rope_parameters"):
            assert getattr(reloaded.config, field, None) == getattr(
                cls.config_class.from_pretrained(hf_dir), field, None), (hf_dir, field)


def test_experts_map_by_global_index_both_ways(tmp_path: Path) -> None:
    checked = {}
    for case in ("qwen3_moe", "mixtral"):
        _make(tmp_path / case, case)
        checked[case] = assert_hf_mapping_round_trips(tmp_path / case)
    qwen = checked["qwen3_moe"][0]
    experts = qwen.arch.experts
    assert (experts.num_experts, experts.topk, experts.ffn_hidden_size, qwen.arch.ffn_hidden_size,
            experts.renormalize_topk, qwen.arch.qk_norm) == (8, 2, 32, 96, True, True)
    mixtral, hf, full = checked["mixtral"]
    assert (mixtral.arch.experts.num_experts, mixtral.arch.experts.ffn_hidden_size,
            mixtral.arch.qk_norm) == (8, 32, False)
    expert, fc1 = "model.layers.1.block_sparse_moe.experts.5.", (
        full["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"])
    assert torch.equal(fc1[:32], hf[expert + "w1.weight"])  # [gate; up]
    assert torch.equal(fc1[32:], hf[expert + "w3.weight"])
    assert torch.equal(full["decoder.layers.1.mlp.router.weight"],
                       hf["model.layers.1.block_sparse_moe.gate.weight"])


def test_unsupported_moe_configs_are_refused_by_name(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_config import family_of, hf_config, read_hf_config

    _make(tmp_path, "qwen3_moe")
    qwen = json.loads((tmp_path / "config.json").read_text())
    mixtral = qwen | {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    for config, fragments in [
            (qwen | {"decoder_sparse_step": 2}, ("decoder_sparse_step=2", "every layer's MLP")),
            (qwen | {"mlp_only_layers": [1]}, ("mlp_only_layers=[1]",)),
            (qwen | {"shared_expert_intermediate_size": 64},
             ("shared_expert_intermediate_size=64", "no shared expert")),
            (qwen | {"num_experts_per_tok": 9}, ("num_experts_per_tok=9 exceeds",)),
            (qwen | {"norm_topk_prob": "yes"}, ("norm_topk_prob='yes'",)),
            (qwen | {"moe_intermediate_size": 0}, ("moe_intermediate_size=0",)),
            (mixtral | {"router_jitter_noise": 0.1}, ("router_jitter_noise=0.1", "jitter")),
            (mixtral | {"sliding_window": 4096}, ("sliding_window=4096", "full attention"))]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=".*".join(map(re.escape, fragments))):
            read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(qwen | {"norm_topk_prob": False}))
    unnormalised, _ = read_hf_config(tmp_path)
    assert hf_config(unnormalised)["model_type"] == "qwen3_moe"
    arch = unnormalised.arch
    for changed, fragment in [
            (replace(arch, qk_norm=False), "renormalize_topk=False"),
            (replace(arch, experts=replace(arch.experts, shared_ffn_size=64)), "shared_ffn_size=64"),
            (replace(arch, qkv_bias=True), "qkv_bias=True")]:
        with pytest.raises(ValueError, match=f"{fragment}.*is no Hugging Face family"):
            family_of(replace(unnormalised, arch=changed))


def _run_config(actor: Path, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    example = Path(__file__).resolve().parents[2] / "examples" / "ppo_hf_tiny.yaml"
    return load_config(RunConfig, str(example), [
        f"models.actor_checkpoint={actor}", "models.reward_checkpoint=''",
        "models.export_hf=false", "reward.rule=synthetic", "reward.model_weight=0", *overrides])


def _moe_settings(moe) -> tuple:
    return (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_ffn_size,
            moe.renormalize_topk)


def _experts(arch) -> tuple:
    experts = arch.experts
    return (experts.num_experts, experts.topk, experts.ffn_hidden_size, experts.shared_ffn_size,
            experts.renormalize_topk)


def test_a_run_reads_its_checkpoints_experts_with_no_moe_settings(tmp_path: Path) -> None:
    from megatron_rlhf.builder.sources import resolve_sources, role_architectures, role_options
    from megatron_rlhf.models.moe import MoERouting

    _make(tmp_path / "qwen3_moe-softmax", "qwen3_moe-softmax")
    _make(tmp_path / "mixtral", "mixtral")
    make_hf_model(tmp_path / "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", 3,
                  **_SIZES | {"num_experts_per_tok": 3}, num_experts=6,
                  moe_intermediate_size=40, intermediate_size=96, norm_topk_prob=True)
    grpo = ("algorithm.advantage_estimator=grpo", "rollout.samples_per_prompt=2")
    for name, expected, overrides in [("qwen3_moe", (6, 3, 40, 0, True), grpo),
                                      ("qwen3_moe-softmax", (4, 2, 48, 0, False), grpo),
                                      ("mixtral", (8, 2, 32, 0, True), ())]:
        run = _run_config(tmp_path / name, *overrides)
        assert _moe_settings(run.models.moe) == expected, name
        sources = resolve_sources(run)
        assert _experts(role_architectures(run, sources)["actor"]) == expected, name
        # the experts are the architecture's; the options carry the routing alone
        assert role_options(run, sources, "actor").moe == MoERouting(), name
    # settings the checkpoint does not give stay the config's; matching ones are accepted
    run = _run_config(tmp_path / "qwen3_moe", "models.moe.num_experts=6",
                      "models.moe.renormalize_topk=true", "models.moe.aux_loss_coeff=0.001")
    assert _moe_settings(run.models.moe) == (6, 3, 40, 0, True)
    assert run.models.moe.aux_loss_coeff == 0.001


def test_a_setting_that_conflicts_with_the_checkpoints_experts_is_refused(
        tmp_path: Path) -> None:
    _make(tmp_path / "qwen3_moe", "qwen3_moe")
    make_hf_model(tmp_path / "dense", "Qwen3Config", "Qwen3ForCausalLM", 1, **_SIZES,
                  intermediate_size=32)
    qwen = tmp_path / "qwen3_moe"
    for setting, theirs in [("num_experts=4", "num_experts=8"), ("topk=3", "topk=2"),
                            ("ffn_hidden_size=64", "ffn_hidden_size=32"),
                            ("renormalize_topk=false", "renormalize_topk=true")]:
        with pytest.raises(ValueError, match=re.escape(
                f"models.moe.{setting} conflicts with models.actor_checkpoint={qwen}: its "
                f"Qwen3MoeForCausalLM config.json gives {theirs}; drop models.moe.")):
            _run_config(qwen, "algorithm.advantage_estimator=grpo",
                        "rollout.samples_per_prompt=2", f"models.moe.{setting}")
    with pytest.raises(ValueError, match=re.escape(
            f"models.moe.num_experts=8 conflicts with models.actor_checkpoint={tmp_path / 'dense'}"
            ": its Qwen3ForCausalLM config.json gives num_experts=0")):
        _run_config(tmp_path / "dense", "models.moe.num_experts=8")
    assert _run_config(tmp_path / "dense").models.moe.num_experts == 0


def _grpo_job(root: str, actor: str) -> tuple[list, list, int]:
    """Two GRPO steps from the Hugging Face directory ``actor`` with its experts split over both
    ranks; the reference's (the initial policy's) and the trained actor's outputs, and the
    experts of one layer this rank holds."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run import runner

    example = Path(__file__).resolve().parents[2] / "examples" / "ppo_hf_tiny.yaml"
    config = load_config(RunConfig, str(example), [
        f"models.actor_checkpoint={actor}", "models.reward_checkpoint=''",
        "models.export_hf=false", f"models.hf_cache_dir={root}/cache", f"run_dir={root}/run",
        f"prompts.paths=[{root}/prompts.jsonl]", "reward.model_weight=0", "reward.rule=synthetic",
        "algorithm.advantage_estimator=grpo", "rollout.samples_per_prompt=2",
        "placement.strategy=flattening", "placement.parallel.actor.ep=2",
        "placement.parallel.ref.ep=2", "models.moe.num_experts=4", "models.moe.topk=2",
        "models.moe.ffn_hidden_size=32", "actor_optimizer.lr=1e-2",
        "runtime.distributed.timeout_s=90", "generation.max_new_tokens=4"])
    captured = capture_engine()
    runner.run_ppo(config)
    workers = captured["engine"].workers
    ref, trained = (full_logits(workers[role].model, workers[role].pg_collection, _batch()).tolist()
                    for role in ("ref", "actor"))
    return ref, trained, len(workers["actor"].model.decoder.layers[0].mlp.experts.local_experts)


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_grpo_starts_from_a_qwen3_moe_directory_at_ep2(tmp_path: Path) -> None:
    from tools.make_tiny_hf import make_hf_tokenizer, make_tiny_qwen_pair

    make_tiny_qwen_pair(tmp_path)  # the prompts
    actor = tmp_path / "qwen3_moe"
    make_hf_tokenizer(actor, "qwen")
    expected = _outputs(make_hf_model(
        actor, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", 7, **_SIZES | {"vocab_size": 320, "max_position_embeddings": 128},
        num_experts=4, moe_intermediate_size=32, norm_topk_prob=True))
    ref, trained, local_experts = run_on_ranks(_grpo_job, world_size=2,
                                               args=(str(tmp_path), str(actor)), timeout_s=300)[0]
    assert local_experts == 2  # of 4: each rank holds half
    torch.testing.assert_close(torch.tensor(ref), expected, **_TOLERANCE)
    assert (torch.tensor(trained) - expected).abs().max() > 1e-4, "GRPO did not train the experts' model"


def _tp2_job(hf_dir: str, expected: torch.Tensor, out: str) -> None:
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model
    from tools import convert_hf_to_megatron, convert_megatron_to_hf

    convert_hf_to_megatron.main(["--hf-dir", hf_dir, "--out", f"{out}/ckpt", "--tp", "2"])
    description = read_checkpoint_info(f"{out}/ckpt").model
    pgc = whole_world_groups(2, 1)
    # megatron's MoE layer under TP wants sequence parallelism, which runs packed rows
    options = replace(description.build_options(), packed_sequences=True, sequence_parallel=True)
    model = build_gpt_model(description.arch, options, pgc)
    load_model_checkpoint(model, pgc, f"{out}/ckpt")
    torch.testing.assert_close(full_logits(model, pgc, _batch()), expected, **_TOLERANCE)
    convert_megatron_to_hf.main(["--ckpt", f"{out}/ckpt", "--out", f"{out}/hf", "--pp", "2"])


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_experts_split_by_tensor_parallelism_convert_both_ways(tmp_path: Path) -> None:
    expected = _make(tmp_path / "mixtral", "mixtral")
    run_on_ranks(_tp2_job, world_size=2, args=(str(tmp_path / "mixtral"), expected,
                                              str(tmp_path / "out")), timeout_s=240)
    exported = (tmp_path / "out" / "hf" / "model.safetensors").read_bytes()
    assert exported == (tmp_path / "mixtral" / "model.safetensors").read_bytes()
