"""A resume that changes a setting which also lives in the checkpoint's state applies it or is
refused naming the field (docs/reliability.md, "Resuming with changed settings"): a changed
learning rate used to be written into config.yaml and warned about while megatron's scheduler
restored the saved one and trained on at it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_rlhf.runtime.checkpoint_store import commit, hash_files
from tools import run_ppo as run_ppo_tool

_SMALL = ["--placement", "flattening", "rollout.prompts_per_step=8", "rollout.ppo_epochs=1",
          "rollout.num_minibatches=1", "generation.max_new_tokens=4"]


def test_a_resume_with_a_new_learning_rate_trains_at_it_and_saves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.models.trainer import ModelTrainer

    used: list[tuple[float, tuple[float, float], float]] = []
    original = ModelTrainer.train_step

    def recording(self, microbatches, loss_fn):
        result = original(self, microbatches, loss_fn)
        if self is trainers.get("actor"):
            group = self.optimizer.param_groups[0]
            used.append((result["lr"], tuple(group["betas"]), group["weight_decay"]))
        return result

    trainers: dict = {}
    original_init = ModelTrainer.__init__

    def keeping(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if self.settings.SECTION == "actor_optimizer":
            trainers["actor"] = self

    monkeypatch.setattr(ModelTrainer, "train_step", recording)
    monkeypatch.setattr(ModelTrainer, "__init__", keeping)
    save_dir, run_dir = tmp_path / "ck", tmp_path / "run"
    common = ["--save-dir", str(save_dir), "--run-dir", str(run_dir), *_SMALL]
    assert run_ppo_tool.main(["--steps", "2", *common, "actor_optimizer.lr=3e-4",
                              "algorithm.kl_coef=0.1"]) == 0
    assert [u[0] for u in used] == [3e-4, 3e-4]
    used.clear()
    assert run_ppo_tool.main([
        "--steps", "4", "--resume", *common, "actor_optimizer.lr=1e-3",
        "actor_optimizer.adam_beta2=0.99", "actor_optimizer.weight_decay=0.01",
        "algorithm.kl_coef=0.2"]) == 0
    assert used == [(1e-3, (0.9, 0.99), 0.01)] * 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["kl_coef"] for m in metrics if m["step"] >= 2] == [0.2, 0.2]
    state = json.loads((save_dir / "step_00000004" / "rl_state.json").read_text())
    scheduler = state["trainers"]["actor"]["scheduler"]
    assert (scheduler["max_lr"], scheduler["start_wd"], scheduler["num_steps"]) == (1e-3, 0.01, 4)
    assert state["ppo"]["kl_controller"]["value"] == 0.2


def test_a_changed_starting_coefficient_of_an_adaptive_kl_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dataclasses import asdict

    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    saved = load_config(RunConfig, None, ["algorithm.adaptive_kl=true", "algorithm.kl_coef=0.1"])
    final = tmp_path / "ck" / "step_00000002"
    temp = final.parent / f"{final.name}.tmp-test"
    temp.mkdir(parents=True)
    (temp / "rl_state.json").write_text(json.dumps({
        "format_version": 1, "step": 2, "tokenizer_fingerprint": "x",
        "ppo": {"kl_controller": {"value": 0.093}},
        "config": json.loads(json.dumps(asdict(saved)))}))
    commit(temp, final, 2, hash_files(temp, ["rl_state.json"]))
    code = run_ppo_tool.main(["--resume", "--save-dir", str(final.parent),
                              "algorithm.adaptive_kl=true", "algorithm.kl_coef=0.3"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("was saved with algorithm.kl_coef=0.1; this run has 0.3, but with "
            "algorithm.adaptive_kl=true kl_coef is only the controller's starting value and a "
            "resumed run continues from the saved coefficient (0.093). Resume with "
            "algorithm.kl_coef=0.1, set algorithm.adaptive_kl=false") in " ".join(err.split())
    assert not dist.is_initialized()
