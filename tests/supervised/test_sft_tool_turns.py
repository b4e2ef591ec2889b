"""A short SFT run on tool-calling demonstrations (records with ``turns``, no ``response``), one
gloo rank: it reads the records, trains, and its loss falls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.multirank import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]


def _write_trajectories(path: Path, count: int, seed: int) -> None:
    """Multiplications the assistant hands to a calculator tool, then reports."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        rows.append({"prompt": f"Multiply {a} by {b}.", "turns": [
            {"role": "assistant", "content": f'<tool_call>{{"a": {a}, "b": {b}}}</tool_call>'},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"The product is {a * b}."}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _sft_on_turns(root: str) -> list[dict[str, float]]:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.supervised_run import SFTConfig
    from megatron_rlhf.supervised.sft import run_sft

    train, held_out = Path(root) / "train.jsonl", Path(root) / "eval.jsonl"
    _write_trajectories(train, 48, seed=0)
    _write_trajectories(held_out, 8, seed=1)
    config = load_config(SFTConfig, ROOT / "examples" / "sft_tiny.yaml", [
        f"out_dir={root}/sft", f"data.paths=[{train}]", f"data.eval_paths=[{held_out}]",
        "data.split.sft=1.0", "data.split.rm=0.0", "data.split.ppo=0.0",
        "data.reader.on_bad_record=error", "train.max_length=128", "train.max_steps=12",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_interval=6",
        "optimizer.lr_warmup_steps=0", "optimizer.lr_schedule=constant"])
    return run_sft(config).history


@pytest.mark.multirank
def test_sft_on_tool_calling_turns_learns(tmp_path: Path) -> None:
    history = run_on_ranks(_sft_on_turns, world_size=1, args=(str(tmp_path),),
                           timeout_s=240)[0]
    losses = [step["loss"] for step in history]
    assert len(losses) == 12
    assert losses[0] > 5.0, "starts near log(512) = 6.24"
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert history[-1]["eval_loss"] < history[5]["eval_loss"], history
    assert (tmp_path / "sft" / "checkpoint").is_dir()
