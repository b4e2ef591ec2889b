"""SFT and reward-model training of mixture-of-experts models (``model.moe``, ``model.ep``).

Tier 1 (no process group): bad expert layouts are refused naming the field; a Hugging Face
``model.init_checkpoint`` gives its experts, and a setting it contradicts is refused. Tier 2
(gloo ranks): a tiny MoE (4 experts, top-2) SFT run learns, reports the routers' metrics and
records its experts; a reward model trains from its trunk; a one-step PPO run starts from the SFT checkpoint
(its reference computes the checkpoint's logits), and a PPO or SFT run configured with other
experts is refused before any process group; SFT at EP 2 gives the losses of EP 1 on 2 ranks; an
SFT run starts from a Hugging Face Qwen3-MoE directory with no ``model.moe`` settings and keeps
its experts; the routers' balancing loss changes the gradient, not the reported loss.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig
from megatron_rlhf.models.checkpoint import read_checkpoint_info
from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.supervised.loop import data_parallel_size
from megatron_rlhf.topology import ClusterSpec, ModelSpec, arch_preset
from megatron_rlhf.topology.models import ExpertSpec
from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_hf_model, make_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MOE = ["model.moe.num_experts=4", "model.moe.topk=2", "model.moe.ffn_hidden_size=128"]
"""4 experts of width 128, top-2; ``router_replay`` stays at its default (true), ignored."""
FIXED_LR = ["optimizer.lr_warmup_steps=0", "optimizer.lr_schedule=constant",
            "data.synthetic.num_test=64"]
QWEN3_MOE = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
             "rms_norm_eps": 1e-6, "initializer_range": 0.1, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
PPO_MOE = [f"models.moe.{o.removeprefix('model.moe.')}" for o in MOE]


def _config(cls: type, out_dir: str, overrides: list[str]):
    example = "sft_tiny.yaml" if cls is SFTConfig else "rm_tiny.yaml"
    return load_config(cls, ROOT / "examples" / example,
                       [f"out_dir={out_dir}", *FIXED_LR, *overrides])


def test_expert_layouts_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "model.ep=2 splits experts, but the models are dense (model.moe.num_experts=0)")):
        _config(SFTConfig, "unused", ["model.ep=2"])
    with pytest.raises(ValueError, match=re.escape(
            "model.ep=3 does not divide model.moe.num_experts=4: choose ep in [1, 2, 4]")):
        _config(SFTConfig, "unused", [*MOE, "model.ep=3"])
    with pytest.raises(ValueError, match=re.escape(
            "model.moe.token_dispatcher=allgather with model.ep=2: megatron's all-gather")):
        _config(SFTConfig, "unused", [*MOE, "model.ep=2", "model.moe.token_dispatcher=allgather"])
    with pytest.raises(ValueError, match=r"model.ep=0 must be >= 1"):
        _config(RMConfig, "unused", [*MOE, "model.ep=0"])
    tiny = arch_preset("tiny")
    arch = replace(tiny, experts=MoEConfig(num_experts=4).expert_spec(tiny.ffn_hidden_size))
    spec = ModelSpec("actor", arch, trainable=True, tp=2, ep=2)
    assert data_parallel_size(spec, ClusterSpec.homogeneous(1, 4)) == 2
    with pytest.raises(ValueError, match=re.escape(
            "model.ep(2) does not divide the data-parallel size dp(1)")):
        data_parallel_size(spec, ClusterSpec.homogeneous(1, 2))


def _ppo_config(checkpoint: str, run_dir: str, *overrides: str):
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, ROOT / "examples" / "ppo_tiny.yaml", [
        f"models.actor_checkpoint={checkpoint}", "models.reward_checkpoint=''",
        "reward.model_weight=0", "reward.rule=synthetic", f"run_dir={run_dir}", "steps=1",
        "rollout.prompts_per_step=4", "rollout.ppo_epochs=1", "generation.max_new_tokens=4",
        *overrides])


def _sft_then_rm_and_ppo(root: str) -> dict:
    import torch

    from megatron_rlhf.engine.run import runner
    from megatron_rlhf.models.checkpoint import load_model_checkpoint
    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.supervised.reward_model import run_reward_training
    from megatron_rlhf.supervised.sft import run_sft
    from tests.helpers.models import full_logits
    from tests.helpers.runs import capture_engine
    from tests.model_fixtures import whole_world_groups

    checkpoint = f"{root}/sft/checkpoint"
    sft = run_sft(_config(SFTConfig, f"{root}/sft", [
        *MOE, "train.max_steps=24", "train.eval_interval=12", "optimizer.lr=2.0e-3"])).history
    rm = run_reward_training(_config(RMConfig, f"{root}/rm", [
        *MOE, f"model.init_checkpoint={checkpoint}", "train.max_steps=4",
        "train.eval_interval=4"])).history
    captured = capture_engine()
    runner.run_ppo(_ppo_config(checkpoint, f"{root}/ppo", *PPO_MOE))
    ids = torch.randint(4, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ref = captured["engine"].workers["ref"]
    description = read_checkpoint_info(checkpoint).model
    groups = whole_world_groups(1, 1)
    saved = build_gpt_model(description.arch, description.build_options(), groups)
    load_model_checkpoint(saved, groups, checkpoint)
    difference = (full_logits(ref.model, ref.pg_collection, batch)
                  - full_logits(saved, groups, batch)).abs().max().item()
    return {"sft": sft, "rm": rm, "ppo_ref_vs_sft": difference}


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_moe_sft_learns_records_its_experts_and_starts_rm_and_ppo(tmp_path: Path) -> None:
    from megatron_rlhf.builder.sources import resolve_sources
    from megatron_rlhf.supervised.sft import run_sft

    runs = run_on_ranks(_sft_then_rm_and_ppo, world_size=1, args=(str(tmp_path),),
                        timeout_s=260)[0]
    sft, rm = runs["sft"], runs["rm"]
    losses = [step["loss"] for step in sft]
    assert sum(losses[-4:]) / 4 < losses[0] - 0.5, losses
    assert sft[-1]["eval_loss"] < sft[11]["eval_loss"]
    for step in sft + rm:  # 4 experts, top-2: the busiest gets between the mean and 2x it
        assert 1.0 <= step["moe_max_load"] <= 2.0 and step["moe_load_balancing_loss"] > 0, step
    assert all(0.0 < step["loss"] < 5.0 for step in rm) and "eval_accuracy" in rm[-1]
    for run, head in (("sft", "lm"), ("rm", "scalar")):
        model = read_checkpoint_info(tmp_path / run / "checkpoint").model
        assert (model.head, model.arch.experts) == (head, ExpertSpec(4, 2, 128))

    # PPO ran a step from the SFT checkpoint: its reference computes the checkpoint's logits.
    assert runs["ppo_ref_vs_sft"] < 1e-6, runs["ppo_ref_vs_sft"]
    first = json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["actor/moe_max_load"] >= 1.0
    checkpoint = tmp_path / "sft" / "checkpoint"
    with pytest.raises(ValueError, match=re.escape(
            f"models.actor_checkpoint={checkpoint} is a mixture-of-experts megatron_rlhf "
            "'actor' checkpoint, but models.moe builds every model with "
            "models.moe.num_experts=0: set models.moe.num_experts=4 models.moe.topk=2")):
        resolve_sources(_ppo_config(str(checkpoint), str(tmp_path / "dense-ppo")))
    # An SFT run from it with other experts is refused before any process group exists.
    with pytest.raises(ValueError, match=re.escape(
            f"model.init_checkpoint={checkpoint} is a mixture-of-experts megatron_rlhf 'actor' "
            "checkpoint, but model.moe builds every model with model.moe.num_experts=4 "
            "model.moe.topk=1")):
        run_sft(_config(SFTConfig, str(tmp_path / "again"), [
            *MOE, "model.moe.topk=1", f"model.init_checkpoint={checkpoint}"]))


def _sft_at_ep(root: str) -> dict:
    from megatron_rlhf.supervised import loop
    from megatron_rlhf.supervised.sft import run_sft

    built, build_model = [], loop.build_model

    def recorded(arch: Any, options: Any, pg_collection: Any, **kwargs: Any) -> Any:
        model = build_model(arch, options, pg_collection, **kwargs)
        experts = model.decoder.layers[0].mlp.experts.local_experts
        built.append((pg_collection.ep.size(), len(experts)))
        return model

    loop.build_model = recorded
    histories = {}
    for ep in (1, 2):
        histories[ep] = run_sft(_config(SFTConfig, f"{root}/ep{ep}", [
            *MOE, f"model.ep={ep}", "train.max_steps=3", "train.eval_interval=3",
            "optimizer.lr=2.0e-3"])).history
    return {"histories": histories, "built": built}


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_sft_at_ep2_gives_the_losses_of_ep1(tmp_path: Path) -> None:
    per_rank = run_on_ranks(_sft_at_ep, world_size=2, args=(str(tmp_path),), timeout_s=260)
    assert per_rank[0]["built"] == [(1, 4), (2, 2)], "EP 2 holds 2 of the 4 experts a rank"
    ranks = [{ep: [{k: v for k, v in step.items() if k != "step_seconds"} for step in steps]
              for ep, steps in rank["histories"].items()} for rank in per_rank]
    assert ranks[0] == ranks[1], "every rank reports the same reduced metrics"
    ep1, ep2 = ranks[0][1], ranks[0][2]
    for key in ("loss", "grad_norm", "eval_loss", "moe_load_balancing_loss", "moe_max_load"):
        want = [step[key] for step in ep1 if key in step]
        got = [step[key] for step in ep2 if key in step]
        assert want and got == pytest.approx(want, rel=1e-5, abs=1e-5), key
    assert ep1[0]["loss"] != ep1[-1]["loss"], "the steps trained"


def _sft_from_hf(root: str, hf_dir: str) -> list[dict[str, float]]:
    from megatron_rlhf.supervised.sft import run_sft

    return run_sft(_config(SFTConfig, f"{root}/sft", [
        f"model.init_checkpoint={hf_dir}", f"model.hf_cache_dir={root}/cache",
        "data.chat_template=false", "train.max_length=120", "train.max_steps=2",
        "train.eval_interval=2", "optimizer.lr=1e-3"])).history


def test_a_hugging_face_init_checkpoint_gives_its_experts_and_refuses_others(
        tmp_path: Path) -> None:
    """As the dense architecture, a Qwen3-MoE directory's experts are read from its config.json;
    a setting it contradicts is refused naming both values (no process group)."""
    hf_dir = tmp_path / "qwen3_moe"
    make_hf_model(hf_dir, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", 5, **QWEN3_MOE)
    for cls in (SFTConfig, RMConfig):
        moe = _config(cls, str(tmp_path / "out"), [f"model.init_checkpoint={hf_dir}"]).model.moe
        assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_ffn_size,
                moe.renormalize_topk) == (4, 2, 32, 0, True), cls
    matching = _config(SFTConfig, str(tmp_path / "out"), [
        f"model.init_checkpoint={hf_dir}", "model.moe.topk=2", "model.ep=2",
        "model.moe.aux_loss_coeff=0.001"]).model
    assert (matching.moe.num_experts, matching.ep, matching.moe.aux_loss_coeff) == (4, 2, 0.001)
    with pytest.raises(ValueError, match=re.escape(
            f"model.moe.topk=3 conflicts with model.init_checkpoint={hf_dir}: its "
            "Qwen3MoeForCausalLM config.json gives topk=2; drop model.moe.topk")):
        _config(SFTConfig, str(tmp_path / "out"), [f"model.init_checkpoint={hf_dir}",
                                                   "model.moe.topk=3"])


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_sft_starts_from_a_qwen3_moe_directory_with_its_experts(tmp_path: Path) -> None:
    hf_dir = tmp_path / "qwen3_moe"
    make_hf_model(hf_dir, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", 5, **QWEN3_MOE)
    make_hf_tokenizer(hf_dir, "qwen")
    # no model.moe settings: the run takes the directory's experts
    history = run_on_ranks(_sft_from_hf, world_size=1, args=(str(tmp_path), str(hf_dir)),
                           timeout_s=260)[0]
    assert all(step["loss"] < 7.0 and step["moe_max_load"] >= 1.0 for step in history), history
    info = read_checkpoint_info(tmp_path / "sft" / "checkpoint")
    experts = info.model.arch.experts
    assert (experts.num_experts, experts.topk, experts.ffn_hidden_size,
            info.model.arch.qk_norm) == (4, 2, 32, True)
    assert info.metadata["hf_config"]["model_type"] == "qwen3_moe"


def _first_steps(root: str) -> dict[str, dict[str, float]]:
    from megatron_rlhf.supervised.sft import run_sft

    return {coeff: run_sft(_config(SFTConfig, f"{root}/aux{coeff}", [
        *MOE, f"model.moe.aux_loss_coeff={coeff}", "train.max_steps=1"])).history[0]
        for coeff in ("0.0", "10.0")}


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_the_balancing_loss_reaches_the_gradient_not_the_reported_loss(tmp_path: Path) -> None:
    steps = run_on_ranks(_first_steps, world_size=1, args=(str(tmp_path),), timeout_s=160)[0]
    without, weighted = steps["0.0"], steps["10.0"]
    # Same weights and data: the token loss and the routing agree; the weighted balancing loss
    # (megatron computes none at coefficient 0) adds its gradient (~0.3% of the norm here).
    assert weighted["loss"] == without["loss"]
    assert weighted["moe_max_load"] == without["moe_max_load"]
    assert "moe_load_balancing_loss" not in without and weighted["moe_load_balancing_loss"] > 0
    assert abs(weighted["grad_norm"] - without["grad_norm"]) > 1e-3 * without["grad_norm"]
