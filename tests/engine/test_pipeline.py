"""The chained InstructGPT run (tokenizer -> SFT -> reward model -> PPO) at a tiny size: the
quickstart's main command, run once per session (tests/conftest.py), checked further."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.launch import run_tool
from tests.helpers.quickstart import TINY, MainJob
from tests.multirank import run_on_ranks


def _ppo_start_against_checkpoints(run_dir: str) -> dict[str, float]:
    """Build the engine of the pipeline's PPO config (``ppo/config.yaml``) on one rank and
    compare the outputs of its actor, reference and reward model on a fixed batch with those of
    models loaded straight from the SFT and reward-model checkpoints; returns the largest
    differences, and how far a freshly initialised model is (the comparison can fail)."""
    import torch

    from megatron_rlhf.builder.sources import resolve_sources
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from tests.helpers.models import full_logits

    initialize_runtime()
    run = Path(run_dir)
    config = load_config(RunConfig, run / "ppo" / "config.yaml",
                         ["placement.strategy=flattening"])
    sources = resolve_sources(config)
    engine = build_engine(config, make_plan(config, cluster_from_environment(), sources),
                          eos_id=3, pad_id=0, sources=sources)

    def checkpoint_output(directory: Path, pg_collection, load: bool = True) -> torch.Tensor:
        description = read_checkpoint_info(directory).model
        model = build_gpt_model(description.arch, description.build_options(), pg_collection)
        if load:
            load_model_checkpoint(model, pg_collection, directory)
        return full_logits(model, pg_collection, batch)

    vocab = engine.workers["actor"].model.real_vocab_size
    ids = torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(7))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    found = {}
    for role, directory in (("actor", "sft"), ("ref", "sft"), ("reward", "rm")):
        worker = engine.workers[role]
        got = full_logits(worker.model, worker.pg_collection, batch)
        want = checkpoint_output(run / directory / "checkpoint", worker.pg_collection)
        found[role] = float((got - want).abs().max())
        if role != "ref":
            fresh = checkpoint_output(run / directory / "checkpoint", worker.pg_collection,
                                      load=False)
            found[f"{role}_vs_fresh"] = float((got - fresh).abs().max())
    return found


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pipeline_chains_sft_rm_and_ppo(quickstart_main_job: MainJob) -> None:
    """The quickstart's main command (tools/run_pipeline.py on 2 ranks, separation; 2 SFT, 2
    reward-model and 1 PPO steps: tests/helpers/quickstart.py), run once for this test and
    tests/test_quickstart.py (a setup of up to 240 s, within this test's timeout). That SFT
    learns over the pipeline's SFT configuration, and PPO's records over several steps and
    evaluation intervals, are checked on tests/engine/test_evaluation.py's run of the same
    pipeline (12 SFT steps, 3 PPO steps)."""
    run_dir = quickstart_main_job.run_dir
    done = quickstart_main_job.result
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward model: step" in done.stdout and (run_dir / "curves.png").stat().st_size > 0
    flags = TINY["run_pipeline.py"][0]
    sft_steps = int(flags[flags.index("--sft-steps") + 1])
    sft = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").open()]
    assert [r["step"] for r in sft] == list(range(sft_steps))
    records = [json.loads(line) for line in (run_dir / "ppo" / "metrics.jsonl").open()]
    # The last record is the held-out evaluation after the last step (tests/engine/
    # test_evaluation.py checks what it holds).
    ppo = records[:-1]
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward_mean", "rm_score", "rule_score", "kl", "policy_loss", "value_loss",
                "samples_per_s"):
        assert all(key in record for record in ppo), key
    # PPO started from the SFT actor and the trained reward model, not from fresh weights.
    plan_roles = json.loads((run_dir / "ppo" / "plan.json").read_text())["models"]
    assert "shadow_actor" in plan_roles  # separation is the default placement
    config = (run_dir / "ppo" / "config.yaml").read_text()
    assert str(run_dir / "sft" / "checkpoint") in config
    assert str(run_dir / "rm" / "checkpoint") in config
    assert ppo[0]["kl"] == pytest.approx(0.0, abs=1e-5), "step 0: the actor is the reference"
    # The anchor: PPO's models start from the SFT and reward-model weights, output for output.
    start = run_on_ranks(_ppo_start_against_checkpoints, world_size=1, args=(str(run_dir),),
                         timeout_s=120)[0]
    assert max(start[role] for role in ("actor", "ref", "reward")) < 1e-5, start
    assert min(start["actor_vs_fresh"], start["reward_vs_fresh"]) > 1e-3, start


@pytest.mark.multirank
def test_pipeline_refuses_a_bad_data_file_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\nnot json\n')
    done = run_tool("run_pipeline.py", ["--run-dir", str(tmp_path / "run"), "--data", str(bad)],
                    nproc=2, timeout=200)
    assert done.returncode != 0
    # One clear line per rank, naming the file and line; no Python traceback from our code
    # (torchrun's own report of the failed workers follows it).
    # The set-up summary names the data file too: look past it.
    refusal = done.stderr.split("log: ", 1)[1]
    assert "run_pipeline: " in refusal and "bad.jsonl" in refusal
    assert re.search(r'(megatron_rlhf|tools)/\S+\.py", line', done.stderr) is None
