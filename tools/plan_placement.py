"""Plan where the PPO models live and show it: a table, JSON, or an SVG picture.

    python tools/plan_placement.py --nodes 16 --gpus-per-node 8 --placement separation --tp 8 \
        --model llama-65b --svg separation.svg
    python tools/plan_placement.py --nodes 1 --gpus-per-node 4 --placement 1,1,0.5,0.5 \
        --model tiny --json
    python tools/plan_placement.py --pool A100-80GB:1x8:80:1.0 --pool V100-32GB:2x4:32:0.4 \
        --placement hetero-separation --tp 4 --model llama-7b
    python tools/plan_placement.py --nodes 4 --placement separation --tp 4 --model llama-13b \
        --predict --batch 1024 --prompt-length 256 --generation-length 256     # cost model
    python tools/plan_placement.py --nodes 4 --model llama-13b --auto --batch 1024 --json
    python tools/plan_placement.py --placement separation --model llama-7b --predict \
        --generation-length 4096 --answer-mean 500 --continue-answers --off-policy decoupled

``--placement`` takes a strategy name or a ratio list over actor,critic,ref,reward. An invalid
request exits with status 2 and says what to change. ``--predict`` adds the predicted step
(samples/s, seconds per stage, memory per device, largest batch); ``--auto`` ranks candidate
placements instead (docs/planner.md). Device numbers come from the shipped profile named like the
pool's kind, or from ``--profile`` (tools/calibrate.py writes one). No GPU, torch.distributed or
Megatron needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megatron_rlhf import __version__  # noqa: E402
from megatron_rlhf.algorithms import OFF_POLICY_CORRECTIONS, get_off_policy  # noqa: E402
from megatron_rlhf.planner import (  # noqa: E402
    MEMORY_OPTIONS,
    AnswerLengths,
    HardwareProfile,
    RolloutSpec,
    SearchSpace,
    auto_place,
    explain_choice,
    load_profile,
    predict_step,
    shipped_profiles,
)
from megatron_rlhf.planner.report import format_prediction, format_ranking  # noqa: E402
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
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, default=1)
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--kind", default="A100-80GB", help="device kind of --nodes")
    cluster.add_argument("--memory-gib", type=float,
                         help="device memory (default: the profile's, else 80)")
    cluster.add_argument("--pool", action="append", default=[], metavar="KIND:NxD[:GIB[:SPEED]]",
                         help="a device pool, repeatable; replaces --nodes/--gpus-per-node")
    place = parser.add_argument_group("placement")
    place.add_argument("--placement", default="flattening",
                       help=f"one of {', '.join(STRATEGIES[:-1])}, or ratios like 1,1,0.5,0.5")
    place.add_argument("--train-fraction", type=float, default=0.5)
    place.add_argument("--ac-share", action="store_true", help="critic is a head on the actor")
    place.add_argument("--no-critic", action="store_true",
                       help="a critic-free estimator (grpo, rloo, reinforce++): place actor, ref "
                       "and reward only; ratios are actor,ref,reward")
    place.add_argument("--no-reward", action="store_true",
                       help="scored by rules and reward functions alone (reward.model_weight=0): "
                       "place no reward model; a ratio list keeps its reward entry, unused")
    place.add_argument("--tp", type=int, default=1)
    place.add_argument("--pp", type=int, default=1)
    place.add_argument("--no-distributed-optimizer", action="store_true")
    place.add_argument("--set", action="append", default=[], metavar="ROLE.tp=N",
                       help="per-role override, e.g. shadow_actor.tp=4 (repeatable)")
    place.add_argument("--model", default="llama-7b", choices=sorted(ARCH_PRESETS))
    place.add_argument("--reward-model", choices=sorted(ARCH_PRESETS),
                       help="architecture of critic and reward (default: --model)")
    rollout = parser.add_argument_group("rollout (for --predict and --auto)")
    for flag, default in (("batch", 512), ("prompt-length", 256), ("generation-length", 256),
                          ("ppo-epochs", 1), ("num-minibatches", 1), ("micro-batch-size", 4)):
        rollout.add_argument(f"--{flag}", type=int, default=default)
    rollout.add_argument("--activation-checkpointing", action="store_true")
    rollout.add_argument("--answer-mean", type=float, metavar="TOKENS", help="price answers of "
                         "this mean length, exponentially spread and cut at --answer-max "
                         "(default: every answer --generation-length long)")
    rollout.add_argument("--answer-max", type=int, metavar="TOKENS",
                         help="longest answer (default --generation-length)")
    rollout.add_argument("--memory-options", default=",".join(MEMORY_OPTIONS),
                         help="memory options the planner may add where a plan does not fit "
                         "(comma-separated; the engine runs all of them)")
    rollout.add_argument("--no-overlap", action="store_true",
                         help="price separation synchronously (no generation/training overlap)")
    rollout.add_argument("--reuse-generation-logprobs", action="store_true",
                         help="old log-probs from generation: no policy forward in experience")
    rollout.add_argument("--partial-rollouts", action="store_true",
                         help="one step off, the shadows taking the weights mid-round "
                         "(rollout.partial_rollouts; implies --reuse-generation-logprobs)")
    rollout.add_argument("--continue-answers", action="store_true",
                         help="one step off, answers going on across steps "
                         "(rollout.continue_answers; implies --partial-rollouts)")
    rollout.add_argument("--off-policy", default="none", choices=sorted(OFF_POLICY_CORRECTIONS),
                         help="algorithm.off_policy: decoupled and truncated_is add one actor "
                         "forward per step (the proximal log-probs)")
    rollout.add_argument("--profile", action="append", default=[], metavar="[KIND=]NAME|PATH",
                         help="device profile for pool KIND (default: every pool), repeatable")
    out = parser.add_argument_group("output")
    out.add_argument("--predict", action="store_true", help="add the predicted step")
    out.add_argument("--auto", action="store_true", help="rank candidate placements instead")
    out.add_argument("--top", type=int, default=20, help="candidates shown by --auto")
    out.add_argument("--only", help="--auto: comma-separated strategies to try (custom: ratios)")
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    out.add_argument("--svg", type=Path, help="write a picture of the plan here")
    return parser.parse_args(argv)


def build_cluster(args: argparse.Namespace) -> ClusterSpec:
    """The cluster from --pool, or from --nodes x --gpus-per-node; a pool whose kind names a
    shipped profile takes that profile's link figures (and memory, unless given)."""
    shipped = shipped_profiles()
    texts = args.pool
    if not texts:
        memory = args.memory_gib or (shipped[args.kind].memory_gib if args.kind in shipped
                                     else 80.0)
        texts = [f"{args.kind}:{args.nodes}x{args.gpus_per_node}:{memory}"]
    pools = []
    for pool in (DevicePool.parse(text) for text in texts):
        if pool.kind in shipped:
            profile = shipped[pool.kind]
            pool = dataclasses.replace(pool, intra_node_gbps=profile.intra_node_gbps,
                                       inter_node_gbps=profile.inter_node_gbps)
        pools.append(pool)
    return ClusterSpec(tuple(pools))


def build_profiles(args: argparse.Namespace) -> dict[str, HardwareProfile] | HardwareProfile:
    """--profile entries: KIND=NAME_OR_PATH per pool kind, or one NAME_OR_PATH for every pool."""
    keyed = [text.partition("=") for text in args.profile]
    if len(keyed) == 1 and not keyed[0][1]:
        return load_profile(keyed[0][0])
    if any(not sep for _, sep, _ in keyed):
        raise ValueError("--profile without KIND= applies to every pool: give it alone")
    return {kind: load_profile(value) for kind, _, value in keyed}


def build_rollout(args: argparse.Namespace) -> RolloutSpec:
    """The step's shapes from the rollout flags (answers spread with ``--answer-mean``).

    Raises:
        ValueError: ``--answer-max`` without ``--answer-mean``, or outside
            ``[1, --generation-length]``.
    """
    rollout = RolloutSpec(
        batch=args.batch, prompt_length=args.prompt_length,
        generation_length=args.generation_length, ppo_epochs=args.ppo_epochs,
        num_minibatches=args.num_minibatches, micro_batch_size=args.micro_batch_size,
        activation_checkpointing=args.activation_checkpointing, overlap=not args.no_overlap,
        partial_rollouts=args.partial_rollouts or args.continue_answers,
        continue_answers=args.continue_answers,
        reuse_logprobs=(args.reuse_generation_logprobs or args.partial_rollouts
                        or args.continue_answers),
        proximal_forward=get_off_policy(args.off_policy).needs_proximal)
    if args.answer_mean is None:
        if args.answer_max is not None:
            raise ValueError("--answer-max needs --answer-mean (the mean answer, in tokens)")
        return rollout
    cap = args.generation_length
    longest = cap if args.answer_max is None else args.answer_max
    if not 1 <= longest <= cap:
        raise ValueError(f"--answer-max {longest} must be in [1, --generation-length {cap}]")
    found = AnswerLengths.from_mean_max(min(args.answer_mean, longest), longest)
    return rollout.with_answer_lengths(AnswerLengths(found.lengths, cap, found.source))


def memory_options(args: argparse.Namespace) -> tuple[str, ...]:
    """--memory-options as a tuple (empty for an empty flag)."""
    return tuple(name for name in args.memory_options.split(",") if name)


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
        ac_share=args.ac_share, critic=not args.no_critic, reward=not args.no_reward,
        tp=args.tp, pp=args.pp, distributed_optimizer=not args.no_distributed_optimizer, parallel=overrides,
    )


def run_auto(args: argparse.Namespace, cluster: ClusterSpec, models: dict[str, str]) -> None:
    """Rank candidate placements and print them (text or one JSON object)."""
    space = SearchSpace(strategies=tuple(args.only.split(",")) if args.only else None,
                        ac_share=args.ac_share, critic=not args.no_critic,
                        reward=not args.no_reward, distributed_optimizer=not args.no_distributed_optimizer,
                        memory_options=memory_options(args))
    ranked = auto_place(cluster, models, build_rollout(args), build_profiles(args), space)
    if args.json:
        print(json.dumps({"rollout": build_rollout(args).to_dict(),
                          "candidates": [c.to_dict() for c in ranked],
                          "best": ranked[0].to_dict() if ranked else None,
                          "reason": explain_choice(ranked)}, indent=2))
    else:
        print(format_ranking(ranked, args.top))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("WARNING")
    reward = args.reward_model or args.model
    models = {"actor": args.model, "critic": reward, "ref": args.model, "reward": reward}
    try:
        cluster = build_cluster(args)
        if args.auto:
            logging.getLogger("megatron_rlhf.topology.placement").setLevel(logging.ERROR)
            run_auto(args, cluster, models)
            return
        plan = plan_placement(cluster, build_config(args), models)
        prediction = (predict_step(plan, build_rollout(args), build_profiles(args),
                                   memory_options(args)) if args.predict else None)
    except ValueError as error:
        print(f"plan_placement: error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        body = plan.to_dict()
        if prediction is not None:
            body = {"plan": body, "rollout": build_rollout(args).to_dict(),
                    "prediction": prediction.to_dict()}
        print(json.dumps(body, indent=2))
    else:
        print(format_summary(plan))
        print()
        print(format_prediction(prediction) if prediction else format_table(plan))
    if args.svg:
        args.svg.write_text(render_svg(plan))


if __name__ == "__main__":
    main()
