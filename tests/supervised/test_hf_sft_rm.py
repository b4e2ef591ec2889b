"""SFT and reward-model training started from Hugging Face directories (a Qwen2 policy and a
Qwen2 classifier with the checkpoint's own tokenizer, conversation-shaped records): the runs load
the HF weights (after two small steps every exported tensor is within a step's reach of the
original, which a fresh initialisation is not), keep the tokenizer and the source config, and the
results export back to directories transformers loads, computing the logits (the scores) of the
trained checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_tiny_qwen_pair

ROOT = Path(__file__).resolve().parents[2]
_LR = 1e-5
_IDS = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(3))


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _write_data(path: Path) -> None:
    rows = []
    for i in range(8):
        question = _turn("user", f"Write a short poem about the sea, number {i}.")
        rows.append({"messages": [question, _turn("assistant", "The sea is blue and wide.")],
                     "chosen": [question, _turn("assistant", "Waves roll on the sand.")],
                     "rejected": [question, _turn("assistant", "Ovens bake the bread.")]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _checkpoint_output(directory: str) -> list:
    """The output of the megatron checkpoint at ``directory`` on :data:`_IDS` (logits, or a
    classifier's score at every position), as a list: a tensor would not outlive the rank."""
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model
    from tests.helpers.models import full_logits
    from tests.model_fixtures import whole_world_groups

    description = read_checkpoint_info(directory).model
    groups = whole_world_groups(1, 1)
    model = build_gpt_model(description.arch, description.build_options(), groups)
    load_model_checkpoint(model, groups, directory)
    return full_logits(model, groups, {"input_ids": _IDS,
                                       "attention_mask": torch.ones_like(_IDS)}).tolist()


def _job(root: str, actor: str, reward: str, data: str) -> dict[str, list]:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig
    from megatron_rlhf.supervised.reward_model import run_reward_training
    from megatron_rlhf.supervised.sft import run_sft
    from tools import convert_megatron_to_hf

    common = [f"data.paths=[{data}]", f"data.eval_paths=[{data}]", "data.split.sft=0.5",
              "data.split.rm=0.5", "data.split.ppo=0.0", f"optimizer.lr={_LR}",
              "optimizer.lr_warmup_steps=0", "optimizer.lr_schedule=constant", "optimizer.min_lr=0",
              "train.global_batch_size=2", "train.micro_batch_size=1", "train.max_steps=2",
              "train.max_length=120", f"model.hf_cache_dir={root}/cache"]
    outputs = {}
    for cls, run, example, source, name in ((SFTConfig, run_sft, "sft_tiny.yaml", actor, "sft"),
                                            (RMConfig, run_reward_training, "rm_tiny.yaml",
                                             reward, "rm")):
        config = load_config(cls, ROOT / "examples" / example, [
            *common, f"model.init_checkpoint={source}", f"out_dir={root}/{name}"])
        run(config)
        convert_megatron_to_hf.main(["--ckpt", f"{root}/{name}/checkpoint",
                                     "--out", f"{root}/{name}-hf"])
        outputs[name] = _checkpoint_output(f"{root}/{name}/checkpoint")
    return outputs


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_sft_and_rm_start_from_hf_directories_and_export_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megatron_rlhf.models.checkpoint import read_checkpoint_info
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer

    actor, reward, _ = make_tiny_qwen_pair(tmp_path / "hf")
    _write_data(tmp_path / "data.jsonl")
    ours = run_on_ranks(_job, world_size=1, args=(str(tmp_path), str(actor), str(reward),
                                                  str(tmp_path / "data.jsonl")), timeout_s=300)[0]
    for name, source, loader in (("sft", actor, AutoModelForCausalLM),
                                 ("rm", reward, AutoModelForSequenceClassification)):
        info = read_checkpoint_info(tmp_path / name / "checkpoint")
        assert info.model.arch.qkv_bias and info.metadata["hf_config"]["model_type"] == "qwen2"
        assert info.metadata["tokenizer_fingerprint"] == HFTokenizer.load(source).fingerprint
        assert (tmp_path / name / "tokenizer.json").is_file()
        before = load_file(source / "model.safetensors")
        after = load_file(tmp_path / f"{name}-hf" / "model.safetensors")
        assert before.keys() == after.keys()
        # Adam moves a weight by about lr per step: two steps stay far below a random init's 0.1.
        largest = max((after[k] - before[k]).abs().max().item() for k in before)
        assert 0 < largest < 20 * _LR, (name, largest)
        # The export computes what the trained checkpoint computes: logits, or the score at
        # every position (a tensor present with a wrong layout or scale would pass the above).
        exported = loader.from_pretrained(tmp_path / f"{name}-hf").eval()
        with torch.no_grad():
            if name == "rm":
                hidden = exported.model(input_ids=_IDS).last_hidden_state
                theirs = exported.score(hidden).float()
            else:
                theirs = exported(input_ids=_IDS).logits.float()
        mine = torch.tensor(ours[name])
        torch.testing.assert_close(mine.reshape(theirs.shape), theirs, rtol=1e-4, atol=1e-4)
        loader.from_pretrained(tmp_path / f"{name}-hf")
