"""Run PPO with adaptive model placement.

CPU, tiny models, 4 gloo ranks (the default configuration)::

    torchrun --nproc-per-node 4 tools/run_ppo.py
    torchrun --nproc-per-node 4 tools/run_ppo.py --placement interleaving --steps 20
    torchrun --nproc-per-node 4 tools/run_ppo.py --algorithm grpo rollout.samples_per_prompt=4

``--algorithm`` picks the advantage estimator: gae (with a critic, the default), or the
critic-free grpo, rloo (both need rollout.samples_per_prompt >= 2) and reinforce++, which place
and train no critic (--ratios then takes three values: actor, ref, reward). PPO names the family
all of them train in; ``--algorithm ppo``, gae's old name, still selects gae, with a notice.

GPU cluster (16 nodes of 8 GPUs), Llama-3.1-8B with a reward model under asynchronous
separation (examples/recipes/ holds this and other production recipes)::

    torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        tools/run_ppo.py --config examples/recipes/llama3.1-8b-ppo-async-16x8.yaml

From Hugging Face directories (a ...ForCausalLM policy, a ...ForSequenceClassification reward
model; architecture, weights and tokenizer come from them, and the trained actor and critic are
written back under <run_dir>/hf/step_<k>/; docs/models.md)::

    python tools/make_tiny_hf.py --out hf-tiny
    torchrun --nproc-per-node 2 tools/run_ppo.py --config examples/ppo_hf_tiny.yaml --tp 2
    torchrun --nproc-per-node 8 tools/run_ppo.py models.actor_checkpoint=Qwen2.5-0.5B-Instruct \
        models.reward_checkpoint=my-rm models.export_hf=true prompts.paths=[prefs.jsonl]

Any field of the configuration can be overridden as ``section.key=value`` after the flags, e.g.
``rollout.ppo_epochs=2 generation.temperature=0.7``.

Checkpoints and resume (a preempted job, SIGTERM, or Ctrl-C saves after its current step and
exits 0; a second Ctrl-C aborts at once without saving)::

    torchrun --nproc-per-node 4 tools/run_ppo.py --save-dir ckpt --save-interval 5
    torchrun --nproc-per-node 4 tools/run_ppo.py --save-dir ckpt --resume
    torchrun --max-restarts 3 --nproc-per-node 4 tools/run_ppo.py --save-dir ckpt --resume auto

A fresh run refuses a --save-dir that holds another run's checkpoints; --resume auto continues
when there is a checkpoint and starts fresh otherwise (for requeued or restarted jobs).

Plan without running (one process on a CPU, any world size; no weights are read): the ranks,
process groups, memory per GPU per model and the planner's stage and step times; a plan whose
memory does not fit the GPUs is refused with status 2::

    python tools/run_ppo.py --config examples/recipes/llama3.1-8b-ppo-async-16x8.yaml --plan-only
    python tools/run_ppo.py --plan-only --nodes 2 --gpus-per-node 8 --gpu H200-141GB --json

Exit status: 0 done (or preempted and saved), 1 a rank failed (the message names it and its
stage), NaN/Inf with faults.on_nan=stop or a full disk, 2 bad configuration, data or checkpoint,
130 Ctrl-C while the run starts or a second Ctrl-C (nothing saved).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlhf import __version__
from megatron_rlhf.runtime.patches import add_warning_filters

add_warning_filters()  # megatron-core warns about missing GPU extras while it is imported

from megatron_rlhf.algorithms import ADVANTAGE_ESTIMATORS
from megatron_rlhf.runtime.refusal import RankZeroFirst, refuse
from megatron_rlhf.topology.placement_config import STRATEGIES

if TYPE_CHECKING:  # the configuration's modules import megatron-core: main imports them
    from megatron_rlhf.config.ppo_run import RunConfig

ALGORITHMS = {**{name: name for name in ADVANTAGE_ESTIMATORS}, "ppo": "gae"}
"""``--algorithm`` name -> ``algorithm.advantage_estimator``: every registered estimator, and
``ppo``, the deprecated name of gae (:data:`DEPRECATED_ALGORITHMS`)."""
DEPRECATED_ALGORITHMS = {"ppo": "gae"}
"""Old ``--algorithm`` names -> the estimator's: "ppo" names the family every estimator trains
in (the runs, ``algorithm.policy_loss=ppo``), not the GAE estimator."""

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "examples" / "ppo_tiny.yaml")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run configuration")
    parser.add_argument("--placement", choices=(*STRATEGIES, "auto"),
                        help="placement strategy; auto: the planner's best for this cluster")
    parser.add_argument("--profile", help="hardware profile for --placement auto (a shipped name "
                        "or a tools/calibrate.py JSON; default: the profile of each pool's kind)")
    parser.add_argument("--algorithm", choices=tuple(ALGORITHMS),
                        help="advantage estimator (gae has a critic, the others none; ppo: "
                        "deprecated name of gae)")
    parser.add_argument("--ratios", nargs="+", metavar="RATIO",
                        help="custom placement ratios over actor, critic, ref, reward (actor, ref, "
                        "reward without a critic); implies --placement custom")
    parser.add_argument("--tp", type=int, help="tensor-parallel size of every model")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size of every model but the inference-only "
                        "shadows (placement.parallel.<role>.pp sets one model's)")
    parser.add_argument("--ac-share", action="store_true", help="critic is a head on the actor")
    parser.add_argument("--steps", type=int, help="PPO steps")
    parser.add_argument("--seed", type=int, help="seed of every RNG")
    parser.add_argument("--run-dir", help="where metrics, config and plan are written")
    parser.add_argument("--save-dir", help="where resumable checkpoints are written")
    parser.add_argument("--save-interval", type=int, help="save every N steps (and at the end)")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="auto",
                        help="continue from the latest valid checkpoint in --save-dir; "
                        "--resume auto: continue if --save-dir holds one, else start fresh")
    parser.add_argument("--verbose", action="store_true",
                        help="every rank logs (default: rank 0 only)")
    plan = parser.add_argument_group("plan only (no step runs; one process, any world size)")
    plan.add_argument("--plan-only", action="store_true", help="print the ranks, process groups, "
                      "memory per GPU and predicted step of the run, and exit; refuse a plan that "
                      "does not fit (docs/planner.md)")
    plan.add_argument("--json", action="store_true", help="--plan-only: one JSON line")
    plan.add_argument("--nodes", type=int, help="--plan-only: nodes (default: cluster.pools)")
    plan.add_argument("--gpus-per-node", type=int, help="--plan-only: GPUs per node")
    plan.add_argument("--gpu", help="--plan-only: device kind, a shipped profile such as "
                      "H100-80GB (default: cluster.pools' kind, else A100-80GB)")
    plan.add_argument("--answer-mean", type=float, metavar="TOKENS", help="--plan-only: price "
                      "answers of this mean length, exponentially spread and cut at "
                      "--answer-max (default: every answer max_new_tokens long)")
    plan.add_argument("--answer-max", type=int, metavar="TOKENS",
                      help="--plan-only: longest answer (default generation.max_new_tokens)")
    plan.add_argument("--answer-lengths", metavar="PATH", help="--plan-only: price these "
                      "answers, one per line: a token count, or JSON with a \"tokens\" count or "
                      "a reference answer's text in \"response\" or \"answer\"")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    given = [flag for flag in ("json", "nodes", "gpus_per_node", "gpu", "answer_mean",
                               "answer_max", "answer_lengths") if getattr(args, flag)]
    if given and not args.plan_only:
        parser.error(f"--{given[0].replace('_', '-')} is a --plan-only flag: add --plan-only")
    strategy = None if args.placement == "auto" else args.placement
    flags = {"placement.strategy": strategy, "placement.tp": args.tp,
             "placement.pp": args.pp, "steps": args.steps, "runtime.seed": args.seed,
             "run_dir": args.run_dir, "checkpoint.save_dir": args.save_dir,
             "checkpoint.save_interval": args.save_interval}
    overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
    if args.ratios:
        # nargs="+" also swallows the a.b=c overrides that follow the ratios: hand those back.
        ratios = [value for value in args.ratios if "=" not in value]
        args.overrides = [value for value in args.ratios if "=" in value] + args.overrides
        for value in ratios:
            try:
                float(value)
            except ValueError:
                parser.error(f"argument --ratios: invalid float value: {value!r}")
        overrides += ["placement.strategy=custom", f"placement.ratios=[{','.join(ratios)}]"]
    if args.algorithm in DEPRECATED_ALGORITHMS and os.environ.get("RANK", "0") == "0":
        print(f"run_ppo: --algorithm {args.algorithm} is deprecated: it names the family every "
              f"estimator trains in, not an estimator; the estimator is "
              f"{DEPRECATED_ALGORITHMS[args.algorithm]}: use --algorithm "
              f"{DEPRECATED_ALGORITHMS[args.algorithm]}", file=sys.stderr)
    if args.algorithm:
        overrides.append(f"algorithm.advantage_estimator={ALGORITHMS[args.algorithm]}")
    if args.ac_share:
        overrides.append("placement.ac_share=true")
    if args.verbose:
        overrides.append("runtime.log_all_ranks=true")
    if args.resume is not None and "=" in args.resume:
        # nargs="?" takes a following a.b=c override as the flag's value: hand it back.
        args.overrides.insert(0, args.resume)
        args.resume = "latest"
    if args.resume not in (None, "latest", "auto"):
        parser.error(f"argument --resume: {args.resume!r} is not 'auto' (--resume alone "
                     "continues from the latest checkpoint)")
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={args.resume}")
    return args, overrides + args.overrides


def auto_placement(config: RunConfig, profile: str | None) -> RunConfig:
    """The planner's best placement for this job (see megatron_rlhf/engine/run/auto_placement.py)."""
    from megatron_rlhf.engine.run.auto_placement import choose_placement
    from megatron_rlhf.topology.cluster import cluster_from_environment

    chosen, reason = choose_placement(config, cluster_from_environment(config.cluster.pools),
                                      profile)
    if os.environ.get("RANK", "0") == "0":
        print(f"run_ppo: placement auto -> {chosen.placement.strategy}: {reason}",
              file=sys.stderr)
    return chosen


def plan_only(config: RunConfig, args: argparse.Namespace) -> int:
    """``--plan-only``: print the plan and the planner's prediction (engine/run/plan_only.py);
    exit 2 when the configuration is refused or the plan does not fit in memory."""
    from megatron_rlhf.engine.run.plan_only import answer_lengths, plan_cluster, plan_run

    try:
        cluster = plan_cluster(config, args.nodes, args.gpus_per_node, args.gpu)
        lengths = answer_lengths(config, args.answer_mean, args.answer_max, args.answer_lengths)
        run_plan = plan_run(config, cluster, args.profile, auto=args.placement == "auto",
                            lengths=lengths)
    except (ValueError, FileNotFoundError) as error:
        return refuse("run_ppo", f"bad configuration: {error}")
    print(run_plan.to_json() if args.json else run_plan.format())
    if not run_plan.fits:
        problems = run_plan.prediction.problems
        more = f"; and {len(problems) - 3} more above" if len(problems) > 3 else ""
        return refuse("run_ppo", f"{run_plan.summary_line()}: {'; '.join(problems[:3])}{more}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    # Rank 0 checks the configuration while the other ranks wait, their megatron-core not yet
    # imported: a mistake is said in seconds, once, and the other ranks exit quietly.
    first = RankZeroFirst("run_ppo")
    if first.refused():
        return 2
    from megatron_rlhf.config.loader import ConfigError, load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    try:
        config = load_config(RunConfig, args.config, overrides)
        if not args.plan_only:
            config.check_machine()
    except (ConfigError, ValueError) as error:
        return first.refuse(f"bad configuration: {error}")
    first.accept()
    if args.plan_only:
        try:
            return plan_only(config, args)
        except (ConfigError, ValueError) as error:
            return refuse("run_ppo", f"bad configuration: {error}")
    from megatron_rlhf.engine.run.runner import run_outputs, run_ppo
    from megatron_rlhf.rewards import UserCodeError
    from megatron_rlhf.runtime.checkpoint_store import DiskFullError
    from megatron_rlhf.runtime.distributed import destroy_distributed
    from megatron_rlhf.runtime.faults import EXIT_INTERRUPTED, NonFiniteError, RankFailure

    if args.placement == "auto":
        # After the imports: the other ranks import while rank 0 chooses for them all.
        try:
            config = first.decided("placement", lambda: auto_placement(config, args.profile))
        except (ConfigError, ValueError) as error:
            return refuse("run_ppo", f"bad configuration: {error}")
    # An undestroyed gloo group at interpreter exit can abort the process ("terminate called
    # without an active exception") after a successful run.
    try:
        run_dir = run_ppo(config)
    except (ValueError, FileNotFoundError) as error:
        return refuse("run_ppo", str(error))
    except KeyboardInterrupt:
        # Ctrl-C outside the steps (during them the run stops after the step and saves):
        # one line per rank, and deaf to the SIGINT that torchrun's agent forwards right after.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"run_ppo: rank {os.environ.get('RANK', '0')}: interrupted by Ctrl-C outside a "
              "training step; no checkpoint was written for it", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RankFailure, NonFiniteError, UserCodeError, DiskFullError) as error:
        # The message names the cause (a user's reward function, tool or environment: it, the
        # record and where it raised); a traceback per rank would bury it.
        print(f"run_ppo: rank {os.environ.get('RANK', '0')}: {error}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"run_ppo: done; {run_outputs(config, run_dir)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
