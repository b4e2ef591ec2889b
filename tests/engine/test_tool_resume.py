"""Tool episodes through ``run_ppo`` on 2 gloo ranks: a run saved after step 1 and resumed gives
step 2's metrics bit for bit as the uninterrupted run, tool calls and answers included.

The tool is a user's module written to ``tmp_path`` (outside the package). An untrained tiny
policy never writes a tool call, so each rank swaps the episodes' codec for a stand-in: every
token id divisible by 5 reads as a whole calculator call, and the tools answer often.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import run_on_ranks

USER_MODULE = '''
def calculator(arguments, record):
    a, b, op = int(arguments["a"]), int(arguments["b"]), arguments["op"]
    return str({"+": a + b, "-": a - b, "*": a * b}[op])
'''

CALL = ('<tool_call>{"name": "calculator", "arguments": {"a": 12, "b": 3, "op": "*"}}'
        "</tool_call>")


def _config(root: Path, name: str, *overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
        f"run_dir={root / name}", "steps=2", "placement.strategy=interleaving",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.num_minibatches=1", "rollout.ppo_epochs=1", "generation.max_new_tokens=6",
        "rollout.tools=[{name: 'agent_tools:calculator'}]", "rollout.tool_workers=1",
        "rollout.max_turns=3", "rollout.max_episode_tokens=64", *overrides])


def _runs(tmp_path: str, module_dir: str) -> dict:
    import sys

    from megatron_rlhf.engine.run import runner
    from tests.helpers.runs import whole_and_resumed

    sys.path.insert(0, module_dir)

    class StandInCodec(runner.EpisodeRollouts):
        def __init__(self, config, encode, decode, **kwargs) -> None:
            super().__init__(config, encode,
                             lambda ids: "".join(CALL if t % 5 == 0 else "x" for t in ids),
                             **kwargs)

    runner.EpisodeRollouts = StandInCodec
    return whole_and_resumed(_config, Path(tmp_path))


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_tool_episodes_resume_bit_exactly(tmp_path: Path) -> None:
    (tmp_path / "agent_tools.py").write_text(USER_MODULE)
    results = run_on_ranks(_runs, world_size=2, args=(str(tmp_path), str(tmp_path)),
                           timeout_s=340, env={"PYTHONPATH": str(tmp_path)})
    whole, resumed = results[0]["whole"], results[0]["resumed"]
    assert [m["step"] for m in whole] == [0, 1]
    assert [m["step"] for m in resumed] == [0, 1]
    assert resumed[-1] == whole[-1], "the resumed step 2 equals the uninterrupted one"
    assert resumed[0] == whole[0]
    for metrics in whole:
        assert metrics["rollout/tool_calls"] > 0 and metrics["rollout/turns"] > 1
        assert metrics["rollout/observation_tokens"] > 0 and metrics["rollout/tool_errors"] == 0
