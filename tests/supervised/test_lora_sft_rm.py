"""SFT and reward-model training through LoRA adapters (``model.lora``).

One rank trains the tiny SFT and reward models with rank-8 adapters. SFT's held-out loss falls;
its checkpoint holds the adapters beside a base equal to the layout-independent initialisation
it started from, to the bit. The reward model's new score head trains in full beside its
adapters, every other weight stays as initialised. A checkpoint with adapters is refused as the
starting point of a reward model or a PPO run, which would load its base alone.

A PEFT adapter exported from a model with random adapters (``models.peft_export``) starts an SFT
run (``model.lora.init_adapter_dir``): at step 0 its weights are the exporter's to the bit, and so
are its logits. A directory that holds no adapter, or one of another rank, is refused naming the
field.
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
    out["from_peft"] = _start_from_peft(root, sft_config, groups)
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


def _start_from_peft(root: str, sft_config, groups) -> dict:
    """An SFT run started from the PEFT adapter of a model with random adapters: its model at
    step 0 beside the exporter's (weights and logits of one batch)."""
    from megatron_rlhf.models.description import ModelDescription
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.lora import LoRAConfig, apply_lora
    from megatron_rlhf.models.peft_export import save_peft_adapter
    from megatron_rlhf.models.weights import gather_full_state, init_weights
    from megatron_rlhf.supervised import loop
    from megatron_rlhf.supervised.sft import run_sft
    from megatron_rlhf.topology.models import resolve_arch
    from tests.helpers.models import full_logits, random_lora_b

    arch, lora = resolve_arch(sft_config.model.arch), LoRAConfig(rank=8, alpha=16)
    exporter = build_gpt_model(arch, ModelBuildOptions(), groups)
    init_weights(exporter, groups, seed=sft_config.model.init_seed)
    apply_lora(exporter, lora, seed=5)  # not the run's A
    exported = random_lora_b(exporter, groups)
    save_peft_adapter(f"{root}/adapter", exported, ModelDescription(arch=arch), lora)
    ids = torch.randint(1, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    at_start: dict = {}

    def step_zero(config, objective, trainer, pgc, *rest):
        at_start["state"] = gather_full_state(trainer.model, pgc)
        at_start["logits"] = full_logits(trainer.model, pgc, batch)
        return train_loop(config, objective, trainer, pgc, *rest)

    train_loop, loop._train_loop = loop._train_loop, step_zero
    try:
        run_sft(load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", [
            f"out_dir={root}/sft_peft", "train.max_steps=1", *LORA,
            f"model.lora.init_adapter_dir={root}/adapter"]))
    finally:
        loop._train_loop = train_loop
    want = full_logits(exporter, groups, batch)
    width = at_start["logits"].shape[-1]
    return {"state_differs": sorted(k for k, v in exported.items()
                                    if not torch.equal(at_start["state"][k], v)),
            "logits_diff": (at_start["logits"] - want[..., :width]).abs().max().item(),
            "adapters": sum(1 for k in exported if k.endswith("lora_b"))}


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
    # started from a PEFT adapter: the exporter's weights and logits at step 0, to the bit
    from_peft = result["from_peft"]
    assert from_peft["adapters"] > 0 and from_peft["state_differs"] == []
    assert from_peft["logits_diff"] == 0.0


def test_a_supervised_run_refuses_a_bad_peft_starting_point(tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    for schema, yaml in ((SFTConfig, "sft_tiny.yaml"), (RMConfig, "rm_tiny.yaml")):
        with pytest.raises(ValueError, match=r"^model\.lora\.init_adapter_dir=.* holds no "
                                             r"adapter_config\.json and no adapter_model"):
            load_config(schema, ROOT / "examples" / yaml, [
                f"out_dir={tmp_path}/out", "model.init_checkpoint=''", "model.lora.rank=4",
                f"model.lora.init_adapter_dir={tmp_path}/adapter"])
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has r=8, but model\.lora\.rank=4: set it"):
        load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", [
            f"out_dir={tmp_path}/out", "model.lora.rank=4",
            f"model.lora.init_adapter_dir={tmp_path}/adapter"])
