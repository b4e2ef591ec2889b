"""Tool episodes: the turn-by-turn loop, which waits for every tool of a turn, against the loop
that overlaps the tools' waits with other episodes' decoding.

    .venv/bin/python benchmarks/episode_overlap.py          # ~1 minute on 2 CPU cores

One process (a gloo world of one), TP=1, ``benchmarks/ppo_step.py``'s default shape (4 layers,
hidden 256, vocabulary 512), fp32, seeded random weights, continuous batching. ``--episodes``
prompts of 6-15 random tokens, at most ``--turns`` replies of up to ``--new-tokens`` tokens
each and ``--episode-tokens`` tokens in all. A random model never writes a tool call, so a
stand-in codec reads a tenth of the vocabulary as a whole call (most replies call a tool) and
``--end-ids`` other ids end a reply. Every call sleeps a time drawn from
``--tool-seconds LOW HIGH`` (seeded per row and turn, the same in both loops), as a remote tool
would; the tools of one turn run concurrently in both loops (threads: a sleeping tool holds no
core). Reports, per loop, the best of ``--repeats`` interleaved runs: ``seconds``,
``episodes_per_s``, ``sampled_tokens_per_s`` (loss-mask tokens), ``generate_calls`` and the
summed tool sleep; ``speedup`` (overlapped over waiting episodes/s) and ``tokens_equal``
(both loops drew the same tokens: the benchmark raises otherwise). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ppo_step import SHAPES  # noqa: E402
from benchmarks.rollouts import _build  # noqa: E402
from megatron_rlhf.generation import GenerationConfig, generate_sequences  # noqa: E402
from megatron_rlhf.generation.episodes import (  # noqa: E402
    EpisodeConfig,
    Episodes,
    FutureAnswers,
    Observation,
    run_episodes,
    run_episodes_overlapped,
)
from megatron_rlhf.topology.models import ArchSpec  # noqa: E402

VOCAB = 512
CALL_IDS = frozenset(range(10, VOCAB, 10))
"""Token ids the stand-in codec reads as a whole tool call (a tenth of the vocabulary)."""
OBSERVATION = [4, 5, 6, 7, 8, 9]
"""The tokens of every tool answer."""


def _decode(ids: list[int]) -> str:
    return "".join("<call>" if t in CALL_IDS else "." for t in ids)


def _run(model, pgc, prompts, bounds: EpisodeConfig, end_ids: list[int], sleeps,
         overlapped: bool, pool: ThreadPoolExecutor) -> tuple[float, int, Episodes]:
    config = GenerationConfig(temperature=1.0, seed=1)
    calls = 0
    turns: dict[int, int] = {}

    def generate(contexts, ids, max_new):
        nonlocal calls
        calls += 1
        config.max_new_tokens = max_new
        return generate_sequences(model, pgc, contexts, ids, config, end_ids, 0)

    def answer(row: int) -> Observation:
        turns[row] = turns.get(row, 0) + 1
        time.sleep(sleeps[row][turns[row] - 1])
        return Observation(list(OBSERVATION))

    args = (generate, prompts, list(range(len(prompts))), bounds, _decode)
    start = time.perf_counter()
    if overlapped:
        answers = FutureAnswers(lambda row, text: pool.submit(answer, row))
        episodes = run_episodes_overlapped(*args, answers, end_ids, 0)
    else:
        episodes = run_episodes(
            *args, lambda rows: list(pool.map(answer, [row for row, _ in rows])), end_ids, 0)
    return time.perf_counter() - start, calls, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--episode-tokens", type=int, default=96)
    parser.add_argument("--end-ids", type=int, default=25, help="end tokens (of 512)")
    parser.add_argument("--tool-seconds", type=float, nargs=2, default=[0.05, 0.5])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_rlhf.runtime.bootstrap import RuntimeConfig, initialize_runtime
    from megatron_rlhf.runtime.patches import cuda_redirect_suspended

    initialize_runtime(RuntimeConfig(log_level="WARNING"))
    model, pgc = _build(ArchSpec("episode_overlap", **SHAPES["default"]), "float32")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
               for n in torch.randint(6, 16, (args.episodes,), generator=generator)]
    end_ids = [i for i in range(VOCAB) if i not in CALL_IDS][3:3 + args.end_ids]
    draw = random.Random(0)
    sleeps = [[draw.uniform(*args.tool_seconds) for _ in range(args.turns)]
              for _ in range(args.episodes)]
    bounds = EpisodeConfig(args.turns, args.episode_tokens, args.new_tokens, stop="<call>")
    start = time.perf_counter()
    best: dict[str, dict] = {}
    outputs: dict[str, Episodes] = {}
    with torch.no_grad(), cuda_redirect_suspended(), ThreadPoolExecutor(args.episodes) as pool:
        _run(model, pgc, prompts[:4], bounds, end_ids, sleeps, False, pool)  # warm-up
        for _ in range(args.repeats):
            for name in ("waiting", "overlapped"):
                seconds, calls, episodes = _run(model, pgc, prompts, bounds, end_ids, sleeps,
                                                name == "overlapped", pool)
                outputs[name] = episodes
                if name not in best or seconds < best[name]["seconds"]:
                    stats = episodes.stats
                    best[name] = {
                        "seconds": round(seconds, 3),
                        "episodes_per_s": round(args.episodes / seconds, 2),
                        "sampled_tokens_per_s": round(
                            int(episodes.output.response_mask.sum()) / seconds, 1),
                        "generate_calls": calls,
                        "tool_calls": int(stats["tool_calls"].sum()),
                        "turns_mean": round(float(stats["turns"].mean()), 2)}
    tokens_equal = torch.equal(outputs["waiting"].output.input_ids,
                               outputs["overlapped"].output.input_ids)
    if not tokens_equal:
        raise RuntimeError("the overlapped loop drew other tokens than the waiting one")
    called = [s[:int(n)] for s, n in zip(sleeps, outputs["waiting"].stats["tool_calls"],
                                          strict=True)]
    print(json.dumps({
        "benchmark": "episode_overlap", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "episodes": args.episodes, "turns": args.turns,
        "new_tokens": args.new_tokens, "tool_seconds": args.tool_seconds,
        "tool_sleep_total_s": round(sum(map(sum, called)), 2), **best,
        "speedup": round(best["overlapped"]["episodes_per_s"]
                         / best["waiting"]["episodes_per_s"], 2),
        "tokens_equal": tokens_equal, "total_s": round(time.perf_counter() - start, 1)}),
        flush=True)


if __name__ == "__main__":
    main()
