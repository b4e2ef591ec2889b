"""Plan where the PPO models live and show it: a table, JSON, or an SVG picture.

    python tools/plan_placement.py --nodes 16 --gpus-per-node 8 --placement separation --tp 8 \
        --model llama-65b --svg separation.svg
    python tools/plan_placement.py --nodes 1 --gpus-per-node 4 --placement 1,1,0.5,0.5 \
        --model tiny --json
    python tools/plan_placement.py --pool A100-80GB:1x8:80:1.0 --pool V100-32GB:2x4:32:0.4 \
        --placement hetero-separation --tp 4 --model llama-7b

``--placement`` takes a strategy name or a ratio list over actor,critic,ref,reward. An invalid
request exits with status 2 and says what to change. No GPU, torch.distributed or Megatron needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megatron_rlhf.runtime.logging import setup_logging  # noqa: E402
from megatron_rlhf.topology import (  # noqa: E402
    ARCH_PRESETS,
    STRATEGIES,
    ClusterSpec,
    DevicePool,
    ParallelOverride,
    PlacementConfig,
    plan_placement,
)
from megatron_rlhf.topology.render import format_summary, format_table, render_svg  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, default=1)
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--kind", default="A100-80GB", help="device kind of --nodes")
    cluster.add_argument("--memory-gib", type=float, default=80.0)
    cluster.add_argument("--pool", action="append", default=[], metavar="KIND:NxD[:GIB[:SPEED]]",
                         help="a device pool, repeatable; replaces --nodes/--gpus-per-node")
    place = parser.add_argument_group("placement")
    place.add_argument("--placement", default="flattening",
                       help=f"one of {', '.join(STRATEGIES[:-1])}, or ratios like 1,1,0.5,0.5")
    place.add_argument("--train-fraction", type=float, default=0.5)
    place.add_argument("--ac-share", action="store_true", help="critic is a head on the actor")
    place.add_argument("--tp", type=int, default=1)
    place.add_argument("--pp", type=int, default=1)
    place.add_argument("--no-distributed-optimizer", action="store_true")
    place.add_argument("--set", action="append", default=[], metavar="ROLE.tp=N",
                       help="per-role override, e.g. shadow_actor.tp=4 (repeatable)")
    place.add_argument("--model", default="llama-7b", choices=sorted(ARCH_PRESETS))
    place.add_argument("--reward-model", choices=sorted(ARCH_PRESETS),
                       help="architecture of critic and reward (default: --model)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--svg", type=Path, help="write a picture of the plan here")
    return parser.parse_args(argv)


def build_cluster(args: argparse.Namespace) -> ClusterSpec:
    """The cluster from --pool, or from --nodes x --gpus-per-node."""
    if args.pool:
        return ClusterSpec(tuple(DevicePool.parse(text) for text in args.pool))
    return ClusterSpec.homogeneous(args.nodes, args.gpus_per_node, args.kind, args.memory_gib)


def build_config(args: argparse.Namespace) -> PlacementConfig:
    """The placement request; an automatic planner (a later --auto) will choose it here."""
    overrides: dict[str, ParallelOverride] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        role, _, name = key.partition(".")
        if name not in ("tp", "pp") or not value.isdigit():
            raise ValueError(f"--set {item!r} must read ROLE.tp=N or ROLE.pp=N")
        setattr(overrides.setdefault(role, ParallelOverride()), name, int(value))
    strategy, ratios = args.placement, None
    if "," in args.placement:
        strategy, ratios = "custom", [float(r) for r in args.placement.split(",")]
    return PlacementConfig(
        strategy=strategy, ratios=ratios, train_fraction=args.train_fraction,
        ac_share=args.ac_share, tp=args.tp, pp=args.pp,
        distributed_optimizer=not args.no_distributed_optimizer, parallel=overrides,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("WARNING")
    reward = args.reward_model or args.model
    models = {"actor": args.model, "critic": reward, "ref": args.model, "reward": reward}
    try:
        plan = plan_placement(build_cluster(args), build_config(args), models)
    except ValueError as error:
        print(f"plan_placement: error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_summary(plan))
        print()
        print(format_table(plan))
    if args.svg:
        args.svg.write_text(render_svg(plan))


if __name__ == "__main__":
    main()
