"""The command line shared by tools/train_sft.py and tools/train_reward_model.py.

Both take the same flags (config, data files, layout, steps, seed, output directory and
``section.key=value`` overrides), run one supervised objective and exit 2 with a one-line message
on bad configuration or data; only the reward model adds ``--init-from``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_rlhf import __version__
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.data import DataError
from megatron_rlhf.runtime.distributed import destroy_distributed
from megatron_rlhf.runtime.refusal import RankZeroFirst, refuse


def parser_for(prog: str, doc: str, default_config: str) -> argparse.ArgumentParser:
    """The common flags; a tool may add its own before parsing."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", default=default_config, help="YAML run configuration")
    parser.add_argument("--data", action="append", metavar="FILE",
                        help="a JSONL/Parquet file, repeatable (default: the synthetic task)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size")
    parser.add_argument("--steps", type=int, help="stop after this many optimizer steps")
    parser.add_argument("--seed", type=int, help="seed of every RNG and of the data order")
    parser.add_argument("--out-dir", help="run directory (must not hold a checkpoint)")
    parser.add_argument("--verbose", action="store_true",
                        help="every rank logs (default: rank 0 only)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def overrides_from(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> list[str]:
    """The flags as ``key=value`` overrides, then the free overrides."""
    flags = {"model.tp": args.tp, "model.pp": args.pp, "train.max_steps": args.steps,
             "runtime.seed": args.seed, "out_dir": args.out_dir,
             "data.paths": f"[{','.join(args.data)}]" if args.data else None,
             "runtime.log_all_ranks": "true" if args.verbose else None, **(extra or {})}
    return [f"{key}={value}" for key, value in flags.items() if value is not None] + args.overrides


def run(prog: str, objective: Callable[[], tuple[type, Callable[[Any], Any]]],
        config_path: str, overrides: list[str], summary: Callable[[Any], str]) -> int:
    """Load, run and report; 2 on bad configuration or data, 0 on success.

    Args:
        objective: imports and returns the configuration's dataclass and the training function;
            called after rank 0's check of the configuration (``RankZeroFirst``), as their
            modules import megatron-core.
    """
    first = RankZeroFirst(prog)
    if first.refused():
        return 2
    schema, train = objective()
    try:
        config = load_config(schema, config_path, overrides)
        config.check_machine()
    except ValueError as error:
        return first.refuse(f"bad configuration: {error}")
    first.accept()
    try:
        result = train(config)
    except DataError as error:
        return refuse(prog, f"bad data: {error}")
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        return refuse(prog, str(error))
    finally:
        destroy_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: done; {summary(result)}, checkpoint in {result.out_dir / 'checkpoint'}",
              file=sys.stderr)
    return 0
