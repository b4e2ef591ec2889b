"""What a checkpoint save costs the step, written synchronously and in the background.

    python benchmarks/checkpoint_save.py                  # 2 ranks, separation, 4 steps
    python benchmarks/checkpoint_save.py --hidden 1024 --layers 8

Two real runs of ``tools/run_ppo.py`` under ``torchrun --standalone``, saving after every step,
one with ``checkpoint.async_save=false`` and one with ``true``, in this process one after the
other. From each run's ``metrics.jsonl`` (the records after the first save, which carry that
save's seconds): the median ``checkpoint/save_s`` (what the step waited for), and for the
background run ``checkpoint/write_s`` (rank 0's background write) and ``checkpoint/commit_s``
(waiting for every rank's write, metadata, hashing, manifest, rename), and the median
``step_seconds``. Also the size of one checkpoint. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, args: argparse.Namespace, out: Path) -> dict:
    """One run; the medians of its save and step seconds."""
    arch = (f"{{num_layers: {args.layers}, hidden_size: {args.hidden}, num_attention_heads: 4, "
            f"ffn_hidden_size: {args.hidden * 11 // 4}, vocab_size: 512, seq_length: 128, "
            "gated_mlp: true}")
    run_dir, save_dir = out / mode / "run", out / mode / "ckpt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.world_size), str(ROOT / "tools" / "run_ppo.py"),
               "--placement", "separation", "--steps", str(args.steps), "--run-dir",
               str(run_dir), "--save-dir", str(save_dir), "--save-interval", "1",
               f"models.arch={arch}", "checkpoint.keep_last=1",
               f"checkpoint.async_save={str(mode == 'background').lower()}",
               "rollout.prompts_per_step=8", "rollout.ppo_epochs=1",
               "rollout.num_minibatches=1", "generation.max_new_tokens=8",
               "evaluation.num_prompts=0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{mode} run exited {done.returncode}:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [r for r in records if "checkpoint/save_s" in r]
    figures = {key: statistics.median(r[key] for r in saved) for key in
               ("checkpoint/save_s", "checkpoint/write_s", "checkpoint/commit_s")
               if all(key in r for r in saved)}
    [last] = sorted(save_dir.glob("step_*"))
    figures.update(step_seconds=statistics.median(r["step_seconds"] for r in records[1:]),
                   checkpoint_mib=sum(p.stat().st_size for p in last.rglob("*")
                                      if p.is_file()) / 2**20, saves_measured=len(saved))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        results = {mode: run(mode, args, Path(temp)) for mode in ("synchronous", "background")}
    print(json.dumps({"benchmark": "checkpoint_save", "world_size": args.world_size,
                      "hidden": args.hidden, "layers": args.layers, "steps": args.steps,
                      **results}))


if __name__ == "__main__":
    main()
