"""SFT and reward-model training: losses, layout invariance, learning, the CLI tools, bad data.

Tier 1 (no process group): the shipped YAMLs, the one-model plan, the two loss functions and the
pair layout. Tier 2 (2 gloo ranks): SFT learns and its losses do not depend on DP/TP/PP; a reward
model started from an SFT trunk (saved at DP=2, loaded at TP=2) ranks held-out pairs well above
chance. The CLI tools run end to end under torchrun, and bad data exits with a clear message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig
from megatron_rlhf.data import RMExample, SyntheticTaskConfig, generate_records
from megatron_rlhf.models.tokenizer import Tokenizer, TokenizerConfig
from megatron_rlhf.supervised.loop import data_parallel_size
from megatron_rlhf.supervised.reward_model import pairwise_loss, preference_microbatches
from megatron_rlhf.supervised.sft import sft_loss
from megatron_rlhf.topology import ClusterSpec, ModelSpec, arch_preset
from tests.helpers.launch import run_tool
from tests.multirank import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
SMALL_TASK = ["data.synthetic.num_test=64"]


class _SoloGroup:
    """Stands in for a tensor-parallel group of one rank."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def test_shipped_configs_load_and_rm_inherits_the_sft_model() -> None:
    sft = load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml")
    rm = load_config(RMConfig, ROOT / "examples" / "rm_tiny.yaml")
    assert (sft.model.arch, rm.model.arch) == ("tiny", "tiny")
    # The RM reads (relative to its YAML) what sft_tiny writes (relative to the working
    # directory) when both are launched from the repository root, as the docs do.
    assert Path(rm.model.init_checkpoint) == ROOT / sft.out_dir / "checkpoint"
    assert rm.train.global_batch_size == sft.train.global_batch_size
    assert sft.data.reader.required == ["prompt", "response"]
    assert rm.data.reader.required == ["prompt", "chosen", "rejected"]
    with pytest.raises(ValueError, match="train.micro_batch_size=0"):
        load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", ["train.micro_batch_size=0"])


def test_pipeline_stage_configs_differ_from_the_tiny_runs_only_in_length_and_split() -> None:
    # tools/run_pipeline.py trains SFT longer than the standalone example (docs/results/main-job-history.md: the
    # SFT model needs it to stop repeating words) and gives the reward model half the prompts;
    # nothing else differs.
    ppo = load_config(RunConfig, ROOT / "examples" / "ppo_pipeline.yaml")
    for cls, tiny, pipeline in ((SFTConfig, "sft_tiny.yaml", "sft_pipeline.yaml"),
                                (RMConfig, "rm_tiny.yaml", "rm_pipeline.yaml")):
        short = load_config(cls, ROOT / "examples" / tiny)
        long = load_config(cls, ROOT / "examples" / pipeline)
        assert long.train.epochs >= short.train.epochs
        assert long.model == short.model and long.optimizer == short.optimizer
        assert dataclasses.replace(long.data, split=short.data.split) == short.data
        # Every stage splits the records alike, so no prompt serves two stages.
        assert dataclasses.asdict(long.data.split) == dataclasses.asdict(ppo.prompts.split)
    sft_tiny = load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml")
    rm_tiny = load_config(RMConfig, ROOT / "examples" / "rm_tiny.yaml")
    assert load_config(SFTConfig, ROOT / "examples" / "sft_pipeline.yaml").train.epochs > \
        sft_tiny.train.epochs
    assert ppo.prompts.split.rm > rm_tiny.data.split.rm


def test_data_parallel_size_of_one_model_over_the_world() -> None:
    def spec(tp: int, pp: int) -> ModelSpec:
        return ModelSpec("actor", arch_preset("tiny"), trainable=True, tp=tp, pp=pp)

    assert data_parallel_size(spec(2, 2), ClusterSpec.homogeneous(2, 4)) == 2
    with pytest.raises(ValueError, match=r"model.tp\(2\) x model.pp\(1\) = 2 does not divide"):
        data_parallel_size(spec(2, 1), ClusterSpec.homogeneous(1, 3))
    with pytest.raises(ValueError, match=r"model.tp\(4\) does not divide the 2 ranks of a node"):
        data_parallel_size(spec(4, 1), ClusterSpec.homogeneous(2, 2))


def test_sft_loss_is_the_response_token_nll_sum() -> None:
    logits = torch.randn(2, 5, 8)
    batch = {"input_ids": torch.randint(0, 8, (2, 5)),
             "loss_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])}
    loss_sum, tokens, metrics = sft_loss(_SoloGroup(), 8)(logits, batch)
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(
        -1, batch["input_ids"][:, 1:, None])[..., 0]
    expected = -(logprobs * batch["loss_mask"][:, 1:]).sum()
    torch.testing.assert_close(loss_sum, expected)
    assert int(tokens) == int(metrics["loss"].weight) == 6
    torch.testing.assert_close(metrics["loss"].total, expected)


def test_pairwise_loss_scores_the_last_real_token_of_each_side() -> None:
    # Two pairs: rows [chosen0, chosen1, rejected0, rejected1], right padding after the scores.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    values = torch.tensor([[0.0, 2.0, 9.0], [0.0, 0.0, -1.0], [1.0, 9.0, 9.0], [0.0, 0.0, 0.5]])
    loss_sum, pairs, metrics = pairwise_loss(_SoloGroup(), 0)(values[..., None],
                                                               {"attention_mask": mask})
    margins = torch.tensor([2.0 - 1.0, -1.0 - 0.5])
    torch.testing.assert_close(loss_sum, -torch.nn.functional.logsigmoid(margins).sum())
    assert int(pairs) == 2 and int(metrics["accuracy"].total) == 1
    assert math.isclose(metrics["margin"].value, -0.25)  # (1 - 1.5) over 2 pairs


def test_preference_microbatches_put_each_pair_in_one_microbatch() -> None:
    tokenizer = Tokenizer.from_config(TokenizerConfig())
    examples = [RMExample(f"Topic: farm {i}.", "cow barn hay.", "the a.") for i in range(4)]
    micro = preference_microbatches(examples, tokenizer, max_length=32, micro_batch_size=2)
    assert len(micro) == 2
    for index, batch in enumerate(micro):
        assert batch["input_ids"].shape[0] == 4
        rows = [ids[mask.bool()].tolist()
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
        for pair, example in enumerate(examples[2 * index:2 * index + 2]):
            prompt = tokenizer.encode(example.prompt, add_bos=True)
            assert rows[pair] == prompt + tokenizer.encode(example.chosen, add_eos=True)
            assert rows[pair + 2] == prompt + tokenizer.encode(example.rejected, add_eos=True)


def _sft(out_dir: str, overrides: list[str]):
    from megatron_rlhf.supervised.sft import run_sft

    config = load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml",
                         [f"out_dir={out_dir}", "optimizer.lr_warmup_steps=0",
                          "optimizer.lr_schedule=constant", *SMALL_TASK, *overrides])
    return run_sft(config).history


def _sft_layouts(root: str) -> dict[str, list[dict[str, float]]]:
    dp2 = _sft(f"{root}/dp2", ["train.max_steps=30", "train.eval_interval=3"])
    tp2 = _sft(f"{root}/tp2", ["train.max_steps=3", "model.tp=2"])
    pp2 = _sft(f"{root}/pp2", ["train.max_steps=3", "model.pp=2"])
    recomputed = _sft(f"{root}/pp2-recompute", ["train.max_steps=3", "model.pp=2",
                                                "model.recompute=full"])
    padded = _sft(f"{root}/dp2-padded", ["train.max_steps=3", "train.eval_interval=3",
                                         "model.packed_sequences=false"])
    return {"dp2": dp2, "tp2": tp2, "pp2": pp2, "pp2-recompute": recomputed,
            "dp2-padded": padded}


@pytest.mark.multirank
def test_sft_loss_falls_and_does_not_depend_on_the_layout(tmp_path: Path) -> None:
    histories = run_on_ranks(_sft_layouts, world_size=2, args=(str(tmp_path),), timeout_s=180)
    runs, other_rank = ({layout: [{k: v for k, v in step.items() if k != "step_seconds"}
                                  for step in steps] for layout, steps in h.items()}
                        for h in histories)
    assert runs == other_rank, "every rank reports the same reduced metrics"
    assert runs.pop("pp2-recompute") == runs["pp2"], "model.recompute=full changed a metric"
    for layout in ("tp2", "pp2", "dp2-padded"):  # dp2 itself runs packed sequences
        for key in ("loss", "grad_norm"):
            reference = [step[key] for step in runs["dp2"][:3]]
            assert [step[key] for step in runs[layout]] == pytest.approx(reference, rel=1e-4), \
                f"{layout} {key} differs from dp2"
        assert runs[layout][2]["eval_loss"] == pytest.approx(runs["dp2"][2]["eval_loss"],
                                                             rel=1e-4)
    losses = [step["loss"] for step in runs["dp2"]]
    assert losses[0] > 6.0, "starts near log(512) = 6.24"
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert runs["dp2"][-1]["eval_loss"] < runs["dp2"][2]["eval_loss"] - 0.7
    lines = (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(30))


def _sft_then_rm(root: str) -> list[dict[str, float]]:
    from megatron_rlhf.supervised.reward_model import run_reward_training

    _sft(f"{root}/sft", ["train.max_steps=40", "train.eval_interval=0",
                         "optimizer.lr=2.0e-3"])
    config = load_config(RMConfig, ROOT / "examples" / "rm_tiny.yaml", [
        f"out_dir={root}/rm", f"model.init_checkpoint={root}/sft/checkpoint", "model.tp=2",
        "train.max_steps=30", "train.eval_interval=10"])
    return run_reward_training(config).history


@pytest.mark.multirank
def test_reward_model_from_sft_trunk_ranks_held_out_pairs(tmp_path: Path) -> None:
    history = run_on_ranks(_sft_then_rm, world_size=2, args=(str(tmp_path),), timeout_s=180)[0]
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=0.05), "a fresh head: ~chance"
    assert history[-1]["eval_accuracy"] > 0.7, history[-1]
    assert history[-1]["eval_loss"] < math.log(2) - 0.1
    info = json.loads((tmp_path / "rm" / "checkpoint" / "megatron_rlhf.json").read_text())
    assert (info["model"]["head"], info["metadata"]["role"], info["tp_size"]) == \
        ("scalar", "reward", 2)


def _write_renamed_jsonl(path: Path) -> None:
    """The synthetic records with other column names, one bad line, and no chosen/rejected."""
    records = generate_records(SyntheticTaskConfig(seed=3, num_train=400), "train")
    lines = [json.dumps({"question": r["prompt"], "answer": r["response"]}) for r in records]
    lines.insert(7, '{"question": "Topic: farm. Answer:"')
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_cli_tools_train_sft_then_reward_model_under_torchrun(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    _write_renamed_jsonl(data)
    sft = run_tool("train_sft.py", [
        "--data", str(data), "--steps", "6", "--out-dir", str(tmp_path / "sft"),
        "data.reader.fields.prompt=question", "data.reader.fields.response=answer",
        "data.split.sft=1", "data.split.rm=0",
        "data.split.ppo=0", "data.eval_fraction=0.2"], nproc=2)
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert "kept 400 of 401 records" in sft.stderr and "invalid_json: 1" in sft.stderr
    # The ranks torchrun starts inherit the suite's NCCL-semantics mode, as forked ranks do.
    assert "initialised gloo world of 2 ranks with NCCL's semantics" in sft.stderr
    rm = run_tool("train_reward_model.py", [
        "--init-from", str(tmp_path / "sft" / "checkpoint"), "--tp", "2", "--steps", "4",
        "--out-dir", str(tmp_path / "rm"), *SMALL_TASK], nproc=2)
    assert rm.returncode == 0, rm.stderr[-3000:]
    assert "loaded the trunk" in rm.stderr and "held-out pairwise accuracy" in rm.stderr
    for run, steps in (("sft", 6), ("rm", 4)):
        out = tmp_path / run
        assert (out / "checkpoint" / "megatron_rlhf.json").is_file()
        assert (out / "tokenizer.model").is_file() and (out / "config.yaml").is_file()
        assert len((out / "metrics.jsonl").read_text().splitlines()) == steps


def test_bad_data_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    _write_renamed_jsonl(data)
    result = run_tool("train_sft.py", [
        "--data", str(data), "--out-dir", str(tmp_path / "sft"), "data.reader.on_bad_record=error",
        "data.reader.fields.prompt=question", "data.reader.fields.response=answer"], timeout=120)
    assert result.returncode == 2
    assert f"train_sft: bad data: bad record at {data} line 8" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "sft" / "checkpoint").exists()
