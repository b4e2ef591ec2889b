"""The golden learning run: a few PPO steps of the tiny CPU job, and its stored per-step metrics.

    python -m tests.golden.learning            # run it, compare with the stored file, say what moved
    python -m tests.golden.learning --update   # ... and store the new figures

``tests/test_golden_learning.py`` runs the same steps and holds them to ``learning.json`` within
:data:`TOLERANCE`: wide enough for another CPU's kernels (fp32 reductions in another order), tight
enough to catch a changed learning rate, a KL coefficient off by 2x or advantages no longer
whitened (each measured against it when the file was made: ``learning.json``'s ``caught``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).with_name("learning.json")
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
OVERRIDES = ["steps=4", "rollout.prompts_per_step=8", "placement.strategy=flattening",
             "evaluation.num_prompts=0"]
WORLD_SIZE = 2
METRICS = ("reward_mean", "kl", "kl_coef", "policy_loss", "value_loss", "returns_mean",
           "response_length", "actor/ppo_kl", "actor/grad_norm", "critic/vpred_mean")
TOLERANCE = {"rtol": 1e-3, "atol": 1e-5}
"""Per metric and step: ``|new - golden| <= atol + rtol * |golden|``."""
PERTURBATIONS = {"learning rate x2": ["actor_optimizer.lr=6.0e-4"],
                 "kl_coef x2": ["algorithm.kl_coef=0.1"],
                 "no advantage whitening": ["algorithm.whiten_advantages=false"]}
"""Changes the tolerance must catch."""


def run_steps(run_dir: str, extra: list[str]) -> list[dict[str, float]]:
    """The golden run on this rank (every rank calls it); the per-step metrics it wrote."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo

    config = load_config(RunConfig, CONFIG, [*OVERRIDES, f"run_dir={run_dir}", *extra])
    out = run_ppo(config)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{name: record[name] for name in METRICS} for record in records
            if "reward_mean" in record]


def measure(extra: list[str] | None = None) -> list[dict[str, float]]:
    """Run the golden steps on :data:`WORLD_SIZE` gloo ranks; rank 0's metrics."""
    from tests.multirank import run_on_ranks

    with tempfile.TemporaryDirectory() as run_dir:
        return run_on_ranks(run_steps, world_size=WORLD_SIZE, args=(run_dir, extra or []),
                            timeout_s=300)[0]


def differences(steps: list[dict[str, float]], golden: list[dict[str, float]]) -> list[str]:
    """One line per metric and step outside the tolerance (empty: within it)."""
    if len(steps) != len(golden):
        return [f"{len(steps)} steps, the golden run has {len(golden)}"]
    moved = []
    for index, (new, old) in enumerate(zip(steps, golden, strict=True)):
        for name in METRICS:
            bound = TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(old[name])
            if not math.isclose(new[name], old[name], abs_tol=bound, rel_tol=0.0):
                moved.append(f"step {index} {name}: {old[name]:.6g} -> {new[name]:.6g} "
                             f"(tolerance {bound:.2g})")
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="store the new figures")
    args = parser.parse_args(argv)
    steps = measure()
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else None
    moved = differences(steps, stored["steps"]) if stored else ["no golden file yet"]
    print("\n".join(moved) if moved else "every metric within the tolerance")
    if not args.update:
        return 1 if moved else 0
    caught = {name: len(differences(measure(extra), steps)) for name, extra in
              PERTURBATIONS.items()}
    missed = [name for name, count in caught.items() if not count]
    if missed:
        print(f"the tolerance does not catch {missed}: not stored", file=sys.stderr)
        return 1
    GOLDEN.write_text(json.dumps({"config": str(CONFIG.name), "overrides": OVERRIDES,
                                  "world_size": WORLD_SIZE, "tolerance": TOLERANCE,
                                  "caught": caught, "steps": steps}, indent=1) + "\n")
    print(f"stored {GOLDEN} (metrics outside the tolerance under each perturbation: {caught})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
