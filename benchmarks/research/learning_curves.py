"""Learning curves of the shipped task under every placement, in one PNG.

    python benchmarks/research/learning_curves.py --out runs/learning   # about 6 minutes on 2 cores

Runs the pipeline once (SFT and reward model, then PPO under flattening), then PPO from the same
SFT checkpoint under each other placement (asynchronous separation included), each on 4 gloo
ranks, with the task's rule as the reward (``--reward rule``, the default) or the trained reward
model (``--reward model``). ``--only`` runs some placements and re-plots all found in ``--out``.
Writes ``<out>/<placement>/metrics.jsonl`` and ``<out>/learning_curves.png``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))  # the curves are drawn as tools/plot_curves.py draws them

from plot_curves import plot, read_metrics  # noqa: E402

HETERO_POOLS = ("cluster.pools=[{kind: fast, nodes: 1, devices_per_node: 2, relative_speed: 1.0},"
                "{kind: slow, nodes: 1, devices_per_node: 2, relative_speed: 0.5}]")
PLACEMENTS = {
    "flattening": ["--placement", "flattening"],
    "interleaving": ["--placement", "interleaving"],
    "interleaving2": ["--placement", "interleaving2"],
    "separation": ["--placement", "separation"],
    "separation-async": ["--placement", "separation", "rollout.async_rollout=true"],
    "hetero-separation": ["--placement", "hetero-separation", HETERO_POOLS],
}
REWARDS = {"rule": ["reward.model_weight=0", "reward.rule_weight=1"],
           "model": ["reward.model_weight=1", "reward.rule_weight=0"]}


def torchrun(script: str, *args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", str(REPO / "tools" / script), *args]
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    parser.add_argument("--steps", type=int, default=80, help="PPO steps per placement")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="rule")
    parser.add_argument("--only", nargs="+", choices=sorted(PLACEMENTS),
                        help="run these placements (others already in --out are plotted too)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    common = [f"steps={args.steps}", *REWARDS[args.reward]]
    pipeline = out / "pipeline"
    if not (pipeline / "rm" / "checkpoint").exists():
        torchrun("run_pipeline.py", "--run-dir", str(pipeline), "--placement", "flattening",
                 *common)
    # The rule as the reward (reward.model_weight=0) runs no reward model: its checkpoint is left out.
    model = [f"models.reward_checkpoint={pipeline / 'rm' / 'checkpoint'}"] * (args.reward == "model")
    checkpoints = [f"models.actor_checkpoint={pipeline / 'sft' / 'checkpoint'}", *model,
                   f"tokenizer.model_path={pipeline / 'sft' / 'tokenizer.model'}",
                   f"prompts.paths=[{pipeline / 'data' / 'train.jsonl'}]"]
    runs = {"flattening": read_metrics(pipeline / "ppo")}
    for name, flags in PLACEMENTS.items():
        if name == "flattening":
            continue
        if args.only is None or name in args.only:
            torchrun("run_ppo.py", "--config", str(REPO / "examples" / "ppo_pipeline.yaml"),
                     "--run-dir", str(out / name), *flags, *common, *checkpoints)
        if (out / name / "metrics.jsonl").exists():
            runs[name] = read_metrics(out / name)
    picture = out / "learning_curves.png"
    plot(runs, ["rule_score", *["rm_score"] * (args.reward == "model"), "kl"], picture, window=8)
    for name, records in runs.items():
        first = sum(r["rule_score"] for r in records[:10]) / 10
        last = sum(r["rule_score"] for r in records[-10:]) / 10
        print(f"{name}: rule score {first:.3f} (first 10 steps) -> {last:.3f} (last 10 steps)")
    print(f"wrote {picture}")


if __name__ == "__main__":
    main()
