"""A ``tools/run_ppo.py`` run that moves to another placement after the steps given, whatever
the re-planner predicts: the GPU check's re-planning part (scripts/gpu_check.sh), so a short run
moves for certain and the move (save, destroying the process groups, building the new placement
under NCCL, loading) runs on the GPUs.

    torchrun --nproc-per-node 2 scripts/gpu_check_move.py --move 0=separation \
        --move 1=flattening --steps 3 placement.replan.interval_steps=1 \
        placement.replan.move=true placement.replan.profile=H100-80GB

``--move STEP=PREFIX`` (repeatable) moves after step STEP to the first candidate placement whose
label starts with PREFIX (``megatron_rlhf.testing.run_hooks.forcing_moves``); every other
argument is ``tools/run_ppo.py``'s. Exit status: 0 done, 1 the run failed, 2 bad arguments or
configuration.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.run_ppo import parse_args  # noqa: E402 - after the checkout is importable


def forced_moves(values: list[str]) -> dict[int, str]:
    """``["0=separation", "1=flattening"]`` -> ``{0: "separation", 1: "flattening"}``.

    Raises:
        ValueError: a value that is not STEP=PREFIX with an integer STEP >= 0.
    """
    moves = {}
    for value in values:
        step, _, prefix = value.partition("=")
        if not step.isdigit() or not prefix:
            raise ValueError(f"--move {value!r}: use STEP=PREFIX, e.g. 0=separation")
        moves[int(step)] = prefix
    return moves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--move", action="append", default=[])
    known, rest = parser.parse_known_args(argv)
    from megatron_rlhf.config.loader import ConfigError, load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.runtime.distributed import destroy_distributed
    from megatron_rlhf.testing.run_hooks import forcing_moves

    args, overrides = parse_args(rest)
    try:
        moves = forced_moves(known.move)
        config = load_config(RunConfig, args.config, overrides)
    except (ConfigError, ValueError) as error:
        print(f"gpu_check_move: bad configuration: {error}", file=sys.stderr)
        return 2
    try:
        with forcing_moves(moves):
            run_ppo(config)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
