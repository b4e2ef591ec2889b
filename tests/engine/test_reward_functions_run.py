"""A user's reward function in a multi-rank GRPO run: every row reaches it with its own prompt's
record (``answer`` and all), in training and in held-out evaluation, its scores are weighted into
the reward and logged, and its worker processes are gone when the run ends.

Two gloo ranks under interleaving (the actor on both, ref on rank 0; at reward.model_weight 0
there is no reward model and ref's ranks score), two responses per prompt and every prompt of the
file in each step, so the logged means are known by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multirank import run_on_ranks

PROMPTS = {"the cat sat on the mat": 1, "the dog ran in the park": 2,
           "a bird sang in the tree": 3, "the sun is warm today": 4}
"""Prompt -> answer: the function scores ``answer / 10``, so a step's mean is 0.25."""


def _config(root: Path, function: str, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
        f"run_dir={root / 'run'}", "steps=2", "placement.strategy=interleaving",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "rollout.num_minibatches=1", "rollout.ppo_epochs=1", "generation.max_new_tokens=6",
        f"prompts.paths=[{root / 'prompts.jsonl'}]", "prompts.split.sft=0",
        "prompts.split.rm=0", "prompts.split.ppo=1", "reward.model_weight=0",
        "reward.rule=none", "reward.workers=2",
        f"reward.functions=[{{name: 'tests.rewards.user_functions:{function}', weight: 2.0}}]",
        *overrides])


def _run(tmp_path: str) -> dict:
    import multiprocessing as mp

    from megatron_rlhf.engine.run.runner import run_ppo

    root = Path(tmp_path)
    run_dir = run_ppo(_config(root, "record_matches_prompt", "evaluation.num_prompts=4",
                              f"evaluation.paths=[{root / 'prompts.jsonl'}]",
                              "evaluation.interval=0"))
    return {"metrics": [json.loads(line) for line in
                        (run_dir / "metrics.jsonl").read_text().splitlines()],
            "children": [process.name for process in mp.active_children()]}


def _run_failing(tmp_path: str) -> dict:
    """A function that raises on one record: the run stops; no worker process is left. Under
    separation the scoring rank is rank 1, so rank 0, which hosts the job's store, outlives it
    and reports its error."""
    import multiprocessing as mp

    from megatron_rlhf.engine.run.runner import run_ppo

    try:
        run_ppo(_config(Path(tmp_path), "fails_on_dog", "placement.strategy=separation"))
    except Exception as error:  # noqa: BLE001 - what each rank stopped with is the result
        return {"error": f"{type(error).__name__}: {error}",
                "children": [process.name for process in mp.active_children()]}
    return {"error": None, "children": []}


def _write_prompts(directory: Path) -> None:
    """The prompts with their answers, as the runs read them (``prompts.jsonl``)."""
    with (directory / "prompts.jsonl").open("w") as out:
        for prompt, answer in PROMPTS.items():
            out.write(json.dumps({"prompt": prompt, "answer": str(answer)}) + "\n")


@pytest.mark.multirank
@pytest.mark.timeout(460)
def test_a_user_reward_function_sees_each_rows_record_on_two_ranks(tmp_path: Path) -> None:
    _write_prompts(tmp_path)
    results = run_on_ranks(_run, world_size=2, args=(str(tmp_path),), timeout_s=400)
    metrics = results[0]["metrics"]
    # Held-out evaluation (the same four prompts) before step 0 and after the last step.
    assert [record["step"] for record in metrics] == [0, 1, 2]
    for record in (metrics[0], metrics[2]):
        for mode in ("greedy", "sampled"):
            assert record[f"eval/{mode}/reward/record_matches_prompt"] == pytest.approx(0.25)
            assert record[f"eval/{mode}/reward/errors"] == 0.0
    assert not any("eval/" in key for key in metrics[1])
    for record in metrics[:2]:
        assert record["reward/record_matches_prompt"] == pytest.approx(0.25)
        assert record["reward/record_matches_prompt/matched"] == pytest.approx(1.0)
        assert record["reward/errors"] == 0.0
        assert record["reward_mean"] == pytest.approx(2.0 * 0.25)  # weight 2, no model score
    assert [result["children"] for result in results] == [[], []]


@pytest.mark.multirank
@pytest.mark.timeout(460)
def test_a_failing_reward_function_stops_the_run_naming_the_record(tmp_path: Path) -> None:
    _write_prompts(tmp_path)
    results = run_on_ranks(_run_failing, world_size=2, args=(str(tmp_path),), timeout_s=400)
    errors = [result["error"] for result in results]
    named = [error for error in errors if error and error.startswith("RewardFunctionError")]
    assert len(named) == 1, errors
    assert ("reward function 'tests.rewards.user_functions:fails_on_dog' raised ValueError: "
            "cannot grade dogs on prompt record #1 ({\"prompt\": \"the dog ran in the park\", "
            "\"answer\": \"2\"})") in named[0]
    (other,) = [error for error in errors if error not in named]
    assert other.startswith("RankFailure: rank ") and named[0].split(": ", 1)[1] in other, (
        "the other rank stops too, naming the scoring rank and the function's error")
    assert [result["children"] for result in results] == [[], []]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (
        tmp_path / "run" / "metrics.jsonl").read_text().strip(), "no step was recorded"
