"""A short PPO run started from Hugging Face directories (a Qwen2 policy and a Qwen2 reward model
with the checkpoint's own tokenizer and chat template, conversation-shaped prompts), at TP=2 on two
gloo ranks, exported back: transformers loads the exported policy, critic and tokenizer, and the
policy's logits equal our final policy's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.hf_fixtures import make_hf_model, make_hf_tokenizer
from tests.multirank import run_on_ranks

_SIZES = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-6, "initializer_range": 0.1}
_IDS = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))


def _make_sources(root: Path) -> tuple[Path, Path, Path]:
    actor, reward, tokenizer = root / "qwen-policy", root / "qwen-rm", root / "tokenizer"
    make_hf_tokenizer(tokenizer, "qwen")
    ids = json.loads((tokenizer / "generation_config.json").read_text())["eos_token_id"]
    for directory, model_cls in ((actor, "Qwen2ForCausalLM"),
                                 (reward, "Qwen2ForSequenceClassification")):
        make_hf_model(directory, "Qwen2Config", model_cls, seed=len(model_cls), **_SIZES,
                      num_labels=1, tie_word_embeddings=True, eos_token_id=ids[0],
                      pad_token_id=ids[1])
        for file in tokenizer.iterdir():  # the hub ships the same tokenizer with both models
            shutil.copyfile(file, directory / file.name)
    prompts = root / "prompts.jsonl"
    turns = [[{"role": "user", "content": f"Write a short poem about the sea, number {i}."}]
             for i in range(8)]
    prompts.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    return actor, reward, prompts


def _config(root: Path, actor: Path, reward: Path, prompts: Path):
    from megatron_rlhf.data import ReaderConfig, SplitConfig
    from megatron_rlhf.engine.config import (
        ModelsConfig,
        PromptsConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
    )
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig
    from megatron_rlhf.runtime.distributed import DistributedConfig
    from megatron_rlhf.topology.config import PlacementConfig

    config = RunConfig(
        runtime=RuntimeConfig(seed=3, distributed=DistributedConfig(timeout_s=90)),
        placement=PlacementConfig(strategy="flattening", tp=2),
        models=ModelsConfig(actor_checkpoint=str(actor), reward_checkpoint=str(reward),
                            hf_cache_dir=str(root / "cache"), export_hf=True),
        prompts=PromptsConfig(paths=[str(prompts)], reader=ReaderConfig(required=["prompt"]),
                              split=SplitConfig(sft=0.0, rm=0.0, ppo=1.0)),
        rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=96, micro_batch_size=2),
        generation=GenerationConfig(max_new_tokens=6, seed=1),
        reward=RewardConfig(model_weight=1.0), steps=2, run_dir=str(root / "run"))
    config.actor_optimizer.lr = 1e-2
    return config


def _job(root: str, actor: str, reward: str, prompts: str) -> list:
    from megatron_rlhf.engine import runner
    from tests.models.test_checkpoint import full_logits

    captured = {}
    build = runner.build_engine

    def keep(*args, **kwargs):
        captured["engine"] = build(*args, **kwargs)
        return captured["engine"]

    runner.build_engine = keep
    try:
        runner.run_ppo(_config(Path(root), Path(actor), Path(reward), Path(prompts)))
    finally:
        runner.build_engine = build
    worker = captured["engine"].workers["actor"]
    logits = full_logits(worker.model, worker.pg_collection,
                         {"input_ids": _IDS, "attention_mask": torch.ones_like(_IDS)})
    return logits.tolist()  # a tensor's shared memory would not outlive the rank


@pytest.mark.multirank
def test_ppo_from_hf_directories_exports_a_model_transformers_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    actor, reward, prompts = _make_sources(tmp_path)
    ours = torch.tensor(run_on_ranks(_job, world_size=2, args=(
        str(tmp_path), str(actor), str(reward), str(prompts)), timeout_s=300)[0])
    export = tmp_path / "run" / "hf" / "step_00000002"
    policy = AutoModelForCausalLM.from_pretrained(export / "actor").eval()
    with torch.no_grad():
        theirs = policy(input_ids=_IDS).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    before, after = load_file(actor / "model.safetensors"), load_file(
        export / "actor" / "model.safetensors")
    assert before.keys() == after.keys()
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.bias"],
                           after["model.layers.0.self_attn.q_proj.bias"]), "PPO did not train"
    critic = AutoModelForSequenceClassification.from_pretrained(export / "critic")
    assert critic.config.num_labels == 1 and critic.config.pad_token_id is not None
    tokenizer = AutoTokenizer.from_pretrained(export / "actor")
    message = [{"role": "user", "content": "Sea?"}]
    assert tokenizer.apply_chat_template(message, tokenize=False) == AutoTokenizer.from_pretrained(
        actor).apply_chat_template(message, tokenize=False)
    assert len(list((tmp_path / "cache").glob("*/full_state.safetensors"))) == 2
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2
