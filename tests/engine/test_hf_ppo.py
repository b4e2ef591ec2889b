"""A short PPO run started from Hugging Face directories (a Qwen2 policy and a Qwen2 reward model
with the checkpoint's own tokenizer and chat template, conversation-shaped prompts), at TP=2 on two
gloo ranks, exported back: transformers loads the exported policy, critic and tokenizer, and the
policy's logits equal our final policy's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_rlhf.runtime.checkpoint_store import verify_checkpoint
from tests.helpers.runs import capture_engine
from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_tiny_qwen_pair

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_hf_tiny.yaml"
_IDS = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))


def _config(root: Path, actor: Path, reward: Path, prompts: Path):
    """The shipped example, pointed at this test's directories."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, str(_EXAMPLE), [
        f"models.actor_checkpoint={actor}", f"models.reward_checkpoint={reward}",
        f"models.hf_cache_dir={root / 'cache'}", f"prompts.paths=[{prompts}]",
        f"run_dir={root / 'run'}", "placement.strategy=flattening", "placement.tp=2",
        "runtime.seed=3", "runtime.distributed.timeout_s=90", "actor_optimizer.lr=1e-2",
        "generation.max_new_tokens=6"])


def _job(root: str, actor: str, reward: str, prompts: str) -> list:
    from megatron_rlhf.engine.run import runner
    from tests.helpers.models import full_logits

    captured = capture_engine()
    runner.run_ppo(_config(Path(root), Path(actor), Path(reward), Path(prompts)))
    worker = captured["engine"].workers["actor"]
    logits = full_logits(worker.model, worker.pg_collection,
                         {"input_ids": _IDS, "attention_mask": torch.ones_like(_IDS)})
    return logits.tolist()  # a tensor's shared memory would not outlive the rank


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_ppo_from_hf_directories_exports_a_model_transformers_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    actor, reward, prompts = make_tiny_qwen_pair(tmp_path)
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


def _padded_job(root: str, actor: str, reward: str, prompts: str) -> None:
    from megatron_rlhf.engine.run.runner import run_ppo

    run_ppo(_padded_config(Path(root), Path(actor), Path(reward), Path(prompts)))


def _padded_config(root: Path, actor: Path, reward: Path, prompts: Path):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, str(_EXAMPLE), [
        f"models.actor_checkpoint={actor}", f"models.reward_checkpoint={reward}",
        f"models.hf_cache_dir={root / 'cache'}", f"prompts.paths=[{prompts}]",
        f"run_dir={root / 'run'}", "models.export_hf=true", "steps=1", "reward.rule=synthetic",
        "placement.ac_share=true", "rollout.reuse_generation_logprobs=true",
        "runtime.distributed.timeout_s=90"])


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_ppo_on_an_embedding_padded_past_the_tokenizer(tmp_path: Path) -> None:
    """The tiny Qwen2 embeds 320 rows for a 300-id tokenizer, as Qwen2.5 pads its embedding: the
    rule reward decodes every response (an id >= 300 would fail), the old log-probs are
    generation's and match the training pass's, and the AC-Share value head that starts on the
    policy's trunk is noted in config.yaml."""
    actor, reward, prompts = make_tiny_qwen_pair(tmp_path)
    run_on_ranks(_padded_job, world_size=1, args=(
        str(tmp_path), str(actor), str(reward), str(prompts)), timeout_s=300)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(record["actor/ppo_kl"]) < 1e-5
    assert (f"# initial weights: actor: the value head is new (drawn from models.init_seed=1234); "
            f"the rest comes from models.actor_checkpoint={actor}") in (
        tmp_path / "run" / "config.yaml").read_text()
    # The export keeps the source's 320 embedding rows (not the padded model's 384), and without
    # checkpoint.save_dir the trained weights were saved before it, in the run directory.
    exported = tmp_path / "run" / "hf" / "step_00000001" / "actor" / "model.safetensors"
    with safe_open(exported, framework="pt") as handle:
        assert handle.get_slice("model.embed_tokens.weight").get_shape() == [320, 64]
    saved = tmp_path / "run" / "checkpoint" / "step_00000001"
    assert verify_checkpoint(saved) == []
