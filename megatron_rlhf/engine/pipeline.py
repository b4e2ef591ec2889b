"""The InstructGPT pipeline in one job: tokenizer -> SFT -> reward model -> PPO.

Every rank runs the three steps in order, in the same processes; each step writes its own run
directory under ``run_dir`` (``sft/``, ``rm/``, ``ppo/``) and the next step starts from the
previous one's checkpoint. The data is the shipped synthetic task (written to ``run_dir/data``)
or the caller's preference files, split into SFT / RM / PPO portions by prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.data import SyntheticTaskConfig, write_task_jsonl
from megatron_rlhf.engine.config import RunConfig
from megatron_rlhf.engine.reward_training import RMConfig, run_reward_training
from megatron_rlhf.engine.runner import run_ppo
from megatron_rlhf.engine.sft import SFTConfig, run_sft
from megatron_rlhf.engine.supervised import CHECKPOINT_DIR, TOKENIZER_FILE
from megatron_rlhf.runtime.bootstrap import initialize_runtime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class PipelineResult:
    """Where each step wrote its run, and its last metrics."""

    run_dir: Path
    final: dict[str, dict]


def _write_data(run_dir: Path, paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """Training and held-out files: the caller's, or the synthetic task written by rank 0."""
    if paths:
        return list(paths), []
    data_dir = run_dir / "data"
    if dist.get_rank() == 0:
        write_task_jsonl(data_dir, SyntheticTaskConfig())
    dist.barrier()
    return [str(data_dir / "train.jsonl")], [str(data_dir / "test.jsonl")]


def _last(path: Path) -> dict:
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else {}


def run_pipeline(run_dir: str | Path, data_paths: Sequence[str], ppo_overrides: Sequence[str],
                 sft_overrides: Sequence[str] = (), rm_overrides: Sequence[str] = ()
                 ) -> PipelineResult:
    """SFT, reward-model training and PPO in sequence; every rank calls it."""
    run_dir = Path(run_dir)
    initialize_runtime()
    train, held_out = _write_data(run_dir, data_paths)
    data = [f"data.paths=[{','.join(train)}]"]
    if held_out:
        data.append(f"data.eval_paths=[{','.join(held_out)}]")
    sft = load_config(SFTConfig, EXAMPLES / "sft_tiny.yaml",
                      [f"out_dir={run_dir / 'sft'}", *data, *sft_overrides])
    run_sft(sft)
    sft_checkpoint = run_dir / "sft" / CHECKPOINT_DIR
    rm = load_config(RMConfig, EXAMPLES / "rm_tiny.yaml",
                     [f"out_dir={run_dir / 'rm'}", f"model.init_checkpoint={sft_checkpoint}",
                      *data, *rm_overrides])
    run_reward_training(rm)
    ppo = load_config(RunConfig, EXAMPLES / "ppo_pipeline.yaml", [
        f"run_dir={run_dir / 'ppo'}", f"models.actor_checkpoint={sft_checkpoint}",
        f"models.reward_checkpoint={run_dir / 'rm' / CHECKPOINT_DIR}",
        f"tokenizer.model_path={run_dir / 'sft' / TOKENIZER_FILE}",
        f"prompts.paths=[{','.join(train)}]", *ppo_overrides])
    run_ppo(ppo)
    final = {step: _last(run_dir / step / "metrics.jsonl") for step in ("sft", "rm", "ppo")}
    return PipelineResult(run_dir, final)
