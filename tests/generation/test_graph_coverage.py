"""Every kind of model that decodes either runs through the graph check or is refused capture.

Under ``MEGATRON_RLHF_EMULATE_CUDA_GRAPHS=1`` a dense model's decode step, alone and in
multi-turn episodes with stop sequences, is captured into the checking stand-in graph. An MoE
model's is not, at any expert parallelism: megatron's token dispatch synchronises with the host
(``masked_select``, ``tolist()``, token counts copied to the host), so ``cuda_graphs=auto``
decodes it eagerly and says why in one logged line, and ``cuda_graphs=on`` is a configuration
error that names the field and the fix before anything is built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_rlhf.generation import GenerationConfig, generate_sequences
from megatron_rlhf.generation import decode_step as decode_step_module
from megatron_rlhf.generation.continuous import release_decode_graphs
from megatron_rlhf.generation.episodes import EpisodeConfig, Observation, run_episodes
from megatron_rlhf.testing.graph_standin import EMULATE_ENV, StandInGraph
from megatron_rlhf.testing.nccl_device_rule import IN_GENERATION_ENV
from tests.generation.helpers import BASE, PAD, assert_same_samples, make_prompts
from tests.multirank import run_on_ranks

REFUSAL = "decoding without CUDA graphs: megatron's MoE token dispatch synchronises"
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [20, 21, 22, 23, 24]]
CONFIG = GenerationConfig(max_new_tokens=8, seed=1, stop_check_interval=2)


class _Lines(logging.Handler):
    """The messages logged through the decode step's logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """The decode step's log lines, with no refusal logged yet in this process."""
    handler = _Lines()
    logger = decode_step_module.logger
    logger.addHandler(handler)
    saved, decode_step_module._REFUSALS_LOGGED = decode_step_module._REFUSALS_LOGGED, set()
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        decode_step_module._REFUSALS_LOGGED = saved


def _moe_model(ep: int):
    """A tiny MoE model (4 experts, top-2) over the world, at expert parallelism ``ep``."""
    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.models.gpt import ModelBuildOptions
    from megatron_rlhf.models.moe import MoEConfig
    from tests.model_fixtures import TinyArch, whole_world_groups

    pgc = whole_world_groups(1, 1, ep=ep)
    experts = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48).expert_spec(0)
    return build_model(TinyArch(num_layers=2, experts=experts), ModelBuildOptions(), pgc,
                       runtime_seed=5, init_seed=9), pgc


def _generate_moe(model, pgc, prompts, cuda_graphs: str) -> list[list[int]]:
    config = dataclasses.replace(CONFIG, cuda_graphs=cuda_graphs)
    out = generate_sequences(model, pgc, prompts, list(range(len(prompts))), config,
                             eos_id=3, pad_id=1)
    return [row[mask.bool()].tolist() for row, mask in
            zip(out.input_ids[:, -out.response_mask.shape[1]:], out.response_mask, strict=True)]


def _moe_refusal(ep: int) -> dict:
    """Two calls under ``auto`` through the stand-in (and one under ``off``): the captures they
    made, the refusal lines they logged, their tokens, and the error ``on`` raises."""
    import torch.distributed as dist

    model, pgc = _moe_model(ep)
    rank = dist.get_rank()
    prompts = PROMPTS[rank::dist.get_world_size()]
    handler = _Lines()
    decode_step_module.logger.addHandler(handler)
    decode_step_module._REFUSALS_LOGGED.clear()
    before = StandInGraph.captures
    auto = [_generate_moe(model, pgc, prompts, "auto") for _ in range(2)]
    captures = StandInGraph.captures - before
    eager = _generate_moe(model, pgc, prompts, "off")
    try:
        _generate_moe(model, pgc, prompts, "on")
        error = ""
    except ValueError as refused:
        error = str(refused)
    decode_step_module.logger.removeHandler(handler)
    return {"captures": captures, "lines": [line for line in handler.lines if REFUSAL in line],
            "auto": auto, "eager": eager, "error": error}


def _check_refusal(result: dict) -> None:
    assert result["captures"] == 0
    assert len(result["lines"]) == 1, result["lines"]  # one line, not one per call
    assert "masked_select" in result["lines"][0] and "tolist()" in result["lines"][0]
    assert result["auto"] == [result["eager"]] * 2
    assert "generation.cuda_graphs=on" in result["error"]
    assert "set generation.cuda_graphs=auto" in result["error"]


def test_a_dense_model_decodes_through_the_graph_check(tiny, end_ids, monkeypatch,
                                                        logged) -> None:
    model, pgc = tiny
    release_decode_graphs(model)
    before = StandInGraph.captures
    monkeypatch.setenv(EMULATE_ENV, "1")
    out = generate_sequences(model, pgc, PROMPTS, [0, 1, 2, 3], BASE, end_ids, PAD)
    release_decode_graphs(model)
    assert StandInGraph.captures > before
    assert not logged
    monkeypatch.delenv(EMULATE_ENV)
    assert_same_samples(out, generate_sequences(model, pgc, PROMPTS, [0, 1, 2, 3], BASE,
                                                end_ids, PAD))


def test_moe_at_ep_1_decodes_eagerly_with_one_logged_line(world, monkeypatch) -> None:
    """Captured, megatron's MoE layer at ep 1 fails the graph check (masked_select)."""
    monkeypatch.setenv(EMULATE_ENV, "1")
    _check_refusal(_moe_refusal(1))


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_moe_at_ep_2_decodes_eagerly_with_one_logged_line() -> None:
    # The expert lockstep's collectives run inside generation: NCCL's device rule checks them.
    per_rank = run_on_ranks(_moe_refusal_job, world_size=2, args=(2,), timeout_s=200,
                            env={EMULATE_ENV: "1", IN_GENERATION_ENV: "1"})
    for result in per_rank:
        _check_refusal(result)


def _moe_refusal_job(ep: int) -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return _moe_refusal(ep)


def test_cuda_graphs_on_for_moe_is_refused_before_anything_is_built() -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    example = Path("examples") / "ppo_moe_tiny.yaml"
    with pytest.raises(ValueError, match=r"generation.cuda_graphs=on cannot capture an MoE "
                                         r"model's decode step .*set generation.cuda_graphs="
                                         r"auto \(decodes it eagerly\) or off"):
        load_config(RunConfig, example, ["generation.cuda_graphs=on"])
    assert load_config(RunConfig, example, []).generation.cuda_graphs == "auto"


def test_multi_turn_episodes_with_stop_sequences_share_one_capture(tiny, monkeypatch,
                                                                   logged) -> None:
    """Every turn of tool episodes (stop sequences in the generator, contexts growing each
    turn) replays one captured step, given the run's ``max_length``; the episodes are those
    of the eager loop."""
    model, pgc = tiny
    prompts = make_prompts([4, 7, 3, 6, 5, 8], seed=2)
    episode = EpisodeConfig(max_turns=3, max_episode_tokens=40, turn_tokens=10, stop="#")
    config = GenerationConfig(temperature=0.9, seed=3, stop_check_interval=1)
    first = generate_sequences(model, pgc, prompts, list(range(6)),
                               dataclasses.replace(config, max_new_tokens=10), 249, PAD)
    stop_ids = sorted(set(first.responses[:, 2].tolist()))  # each row calls a tool in turn 0
    calls = []

    def run():
        def generate(contexts, ids, max_new):
            calls.append(max(len(c) for c in contexts))
            return generate_sequences(model, pgc, contexts, ids, dataclasses.replace(
                config, max_new_tokens=max_new, stop_sequences=[[i] for i in stop_ids]),
                eos_id=249, pad_id=PAD, max_length=8 + episode.max_episode_tokens)
        return run_episodes(generate, prompts, list(range(6)), episode,
                            lambda ids: "".join("#" if t in stop_ids else "." for t in ids),
                            lambda replies: [Observation([7, 8, 9]) for _ in replies],
                            eos_ids=[249], pad_id=PAD)

    release_decode_graphs(model)
    before = StandInGraph.captures
    monkeypatch.setenv(EMULATE_ENV, "1")
    graphs = run()
    release_decode_graphs(model)
    assert StandInGraph.captures - before == 1
    assert len(calls) > 1 and len(set(calls)) > 1, "turns of several context lengths"
    assert not logged
    monkeypatch.delenv(EMULATE_ENV)
    eager = run()
    assert graphs.output.input_ids.shape == eager.output.input_ids.shape
    for name, value in vars(eager.output).items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(getattr(graphs.output, name), value, rtol=0,
                                       atol=1e-5 if value.is_floating_point() else 0, msg=name)
    assert graphs.stats["tool_calls"].sum() >= len(prompts)
