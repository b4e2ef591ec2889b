"""``rollout.overlap_tools``: tool waits overlapped with decoding in ``run_ppo`` on 2 gloo ranks.

A step with TP=2 (the first TP rank calls the tools and sends each collect's answers to the
other) and one with DP=2, each run with the turn-by-turn loop and with the overlapped one: the
rows' tokens and masks are equal, their generation log-probs within 1e-5, while the overlapped
runs make more (smaller) generation calls. The tool is a user's module in ``tmp_path`` that
sleeps on half the calls; a stand-in codec reads every token id divisible by 5 as a call (the
id its argument), as ``test_tool_resume.py`` does. The config refusals run in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multirank import run_on_ranks

USER_MODULE = '''
import time

def slow_double(arguments, record):
    a = int(arguments["a"])
    time.sleep(0.3 if a % 2 else 0.0)
    return str(2 * a)
'''

CALL = '<tool_call>{{"name": "slow_double", "arguments": {{"a": {}}}}}</tool_call>'

LAYOUTS = {"tp2": ("placement.strategy=flattening", "placement.tp=2"),
           "dp2": ("placement.strategy=interleaving",)}


def _config(root: Path, name: str, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
        f"run_dir={root / name}", "steps=1", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2", "rollout.num_minibatches=1", "rollout.ppo_epochs=1",
        "generation.max_new_tokens=6", "rollout.tools=[{name: 'agent_tools:slow_double'}]",
        "rollout.tool_workers=2", "rollout.max_turns=4", "rollout.max_episode_tokens=64",
        *overrides])


def _runs(root: str, module_dir: str) -> dict[str, list[dict[str, list]]]:
    import sys

    from megatron_rlhf.engine.run import runner

    sys.path.insert(0, module_dir)
    rollouts: list[dict[str, list]] = []

    class Recorded(runner.EpisodeRollouts):
        """A stand-in codec, and every rollout this rank generates kept."""

        def __init__(self, config, encode, decode, **kwargs) -> None:
            super().__init__(config, encode, lambda ids: "".join(
                CALL.format(t) if t % 5 == 0 else "x" for t in ids), **kwargs)

        def run(self, *args, **kwargs):
            output, stats = super().run(*args, **kwargs)
            # lists: tensors would travel back through shared memory of an exited rank
            rollouts.append({**{name: value.tolist() for name, value in stats.items()},
                             **{name: getattr(output, name).tolist() for name in (
                                 "input_ids", "attention_mask", "response_mask",
                                 "response_logprobs")},
                             "generate_calls": len(output.micro_batches)})
            return output, stats

    runner.EpisodeRollouts = Recorded
    results = {}
    for layout, overrides in LAYOUTS.items():
        for overlap in ("false", "true"):
            rollouts.clear()
            runner.run_ppo(_config(Path(root), f"{layout}-{overlap}", *overrides,
                                   f"rollout.overlap_tools={overlap}"))
            results[f"{layout}/{overlap}"] = list(rollouts)
    return results


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_overlapped_tools_give_the_turn_loops_rows_on_tp2_and_dp2(tmp_path: Path) -> None:
    (tmp_path / "agent_tools.py").write_text(USER_MODULE)
    per_rank = run_on_ranks(_runs, world_size=2, args=(str(tmp_path), str(tmp_path)),
                            timeout_s=340, env={"PYTHONPATH": str(tmp_path)})
    calls = {"false": 0, "true": 0}
    for rank, results in enumerate(per_rank):
        for layout in LAYOUTS:
            waiting, overlapped = results[f"{layout}/false"], results[f"{layout}/true"]
            assert len(waiting) == len(overlapped) == 1, (layout, rank)
            for name, value in waiting[0].items():
                got = overlapped[0][name]
                if name != "generate_calls":
                    value, got = torch.tensor(value), torch.tensor(got)
                if name == "generate_calls":
                    calls["false"] += value
                    calls["true"] += got
                elif name == "response_logprobs":
                    # other batch compositions: log-probs round differently
                    torch.testing.assert_close(got, value, rtol=0, atol=1e-5,
                                               msg=f"{layout} rank {rank} {name}")
                elif name != "episode_tool_seconds":
                    assert torch.equal(got, value), f"{layout} rank {rank} {name}"
    for layout in LAYOUTS:  # the layout's episodes went on after tool answers
        stats = [results[f"{layout}/false"][0] for results in per_rank]
        assert max(max(rank["episode_turns"]) for rank in stats) > 1, layout
        assert sum(sum(rank["episode_tool_errors"]) for rank in stats) == 0, layout
    # one TP group: both ranks read the same rows
    assert per_rank[0]["tp2/true"] == per_rank[1]["tp2/true"]
    assert calls["true"] > calls["false"], f"no generation call overlapped a tool: {calls}"


def test_overlap_tools_is_refused_where_it_cannot_hold(tmp_path: Path) -> None:
    from megatron_rlhf.config.ppo_run import RolloutConfig
    from megatron_rlhf.engine.execution.episodes import EpisodeRollouts
    from megatron_rlhf.generation.episodes import EpisodeConfig

    with pytest.raises(ValueError, match=r"rollout.overlap_tools=true with "
                       r"rollout.environment: .* set overlap_tools=false"):
        RolloutConfig(environment={"name": "tests.rewards.user_envs:Countdown"},
                      max_turns=2, max_episode_tokens=32, overlap_tools=True)
    with pytest.raises(ValueError, match=r"rollout.overlap_tools=true overlaps the calls of "
                       r"rollout.tools, which is empty"):
        RolloutConfig(overlap_tools=True)
    config = RolloutConfig(tools=[{"name": "tests.rewards.user_tools:naps"}], max_turns=2,
                           max_episode_tokens=32, overlap_tools=True)
    assert config.overlap_tools
    # expert parallelism: every rank of an expert group must run as many forwards; episodes
    # of several turns are refused there with either loop, one turn makes one call in both
    from megatron_rlhf.config.ppo_run import ModelsConfig, RunConfig
    from megatron_rlhf.models.moe import MoEConfig
    from megatron_rlhf.topology.placement_config import ParallelOverride, PlacementConfig

    def expert_parallel(turns: int) -> RunConfig:
        return RunConfig(placement=PlacementConfig(parallel={"actor": ParallelOverride(ep=2)}),
                         models=ModelsConfig(moe=MoEConfig(num_experts=4)),
                         rollout=RolloutConfig(tools=[{"name": "operator:add"}],
                                               max_turns=turns, max_episode_tokens=64,
                                               overlap_tools=True))

    expert_parallel(1)
    with pytest.raises(ValueError, match=r"actor.ep=2 with multi-turn episodes"):
        expert_parallel(2)
    with pytest.raises(ValueError, match="an environment has none"):
        EpisodeRollouts(EpisodeConfig(2, 32, 8, stop=None), list, str,
                        environment=object(), overlap_tools=True)
