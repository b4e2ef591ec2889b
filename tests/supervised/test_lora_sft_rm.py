"""SFT and reward-model training through LoRA adapters (``model.lora``).

One rank trains the tiny SFT and reward models with rank-8 adapters. SFT's held-out loss falls;
its checkpoint holds the adapters beside a base equal to the layout-independent initialisation
it started from, to the bit. The reward model's new score head trains in full beside its
adapters, every other weight stays as initialised. A checkpoint with adapters is refused as the
starting point of a reward model or a PPO run, which would load its base alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig
from tests.multirank import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=1e-2",
        "optimizer.lr_warmup_steps=0", "optimizer.lr_schedule=constant"]


def _train(root: str) -> dict:
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.models.lora import LoRAConfig, apply_lora, is_adapter_param
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.supervised.reward_model import run_reward_training
    from megatron_rlhf.supervised.sft import run_sft
    from tests.model_fixtures import whole_world_groups

    sft_config = load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", [
        f"out_dir={root}/sft", "train.max_steps=12", "train.eval_interval=6", *LORA])
    sft = run_sft(sft_config).history
    rm = run_reward_training(load_config(RMConfig, ROOT / "examples" / "rm_tiny.yaml", [
        f"out_dir={root}/rm", "model.init_checkpoint=''", "train.max_steps=4",
        "train.eval_interval=4", *LORA])).history

    out: dict = {"sft": sft, "rm": rm, "refusals": []}
    rm_from_sft = load_config(RMConfig, ROOT / "examples" / "rm_tiny.yaml", [
        f"out_dir={root}/rm2", f"model.init_checkpoint={root}/sft/checkpoint"])
    ppo_from_sft = load_config(RunConfig, ROOT / "examples" / "ppo_grpo_tiny.yaml", [
        f"run_dir={root}/ppo", f"models.actor_checkpoint={root}/sft/checkpoint", "steps=1"])
    for run, config in ((run_reward_training, rm_from_sft), (run_ppo, ppo_from_sft)):
        try:
            run(config)
        except ValueError as error:
            out["refusals"].append(str(error))
    groups = whole_world_groups(1, 1)
    for name in ("sft", "rm"):
        checkpoint = f"{root}/{name}/checkpoint"
        description = read_checkpoint_info(checkpoint).model
        saved = build_gpt_model(description.arch, description.build_options(), groups)
        initial = build_gpt_model(description.arch, description.build_options(), groups)
        init_weights(initial, groups, seed=sft_config.model.init_seed)
        apply_lora(saved, LoRAConfig(rank=8, alpha=16))
        load_model_checkpoint(saved, groups, checkpoint)
        start = dict(initial.named_parameters())
        params = dict(saved.named_parameters())
        out[name + "_changed"] = sorted(
            n for n, p in params.items() if not is_adapter_param(n) and not torch.equal(p, start[n]))
        out[name + "_b_moved"] = all(p.abs().sum() > 0 for n, p in params.items()
                                     if n.endswith("lora_b"))
    return out


@pytest.mark.multirank
def test_sft_and_rm_train_adapters_and_keep_the_base(tmp_path: Path) -> None:
    result = run_on_ranks(_train, world_size=1, args=(str(tmp_path),), timeout_s=240)[0]
    losses = [entry["eval_loss"] for entry in result["sft"] if "eval_loss" in entry]
    assert losses[-1] < losses[0], losses
    assert result["sft_changed"] == [] and result["sft_b_moved"]
    assert result["rm_changed"] == ["output_layer.weight"] and result["rm_b_moved"]
    assert len(result["refusals"]) == 2
    for field, refusal in zip(("model.init_checkpoint", "models.actor_checkpoint"),
                              result["refusals"], strict=True):
        assert refusal.startswith(f"{field}=") and "holds LoRA adapters" in refusal, refusal
        assert "merge them into the base first" in refusal


def test_a_supervised_run_refuses_a_peft_starting_point(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.init_adapter_dir=.*do not read a PEFT"):
        load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", [
            f"out_dir={tmp_path}", "model.lora.rank=4", f"model.lora.init_adapter_dir={tmp_path}"])
