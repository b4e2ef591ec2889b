"""Plot metrics of one or more runs (their ``metrics.jsonl``) into one PNG.

    python tools/plot_curves.py runs/flat runs/sep --metrics reward_mean rule_score \\
        --out curves.png

One panel per metric, one line per run (labelled by the run directory's name), a light
moving average drawn over the raw points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: Path) -> list[dict]:
    """The per-step records of a run directory (or a metrics.jsonl path)."""
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise SystemExit(f"plot_curves: no metrics at {path}; pass a run directory of run_ppo")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot(runs: dict[str, list[dict]], metrics: list[str], out: Path, window: int,
         raw: frozenset[str] = frozenset()) -> None:
    """Write one panel per metric with a line per run; runs named in ``raw`` (sparse points
    such as held-out evaluations) are drawn unsmoothed, with markers."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        # A run keeps its colour in every panel, also where an earlier run has no points.
        for index, (label, records) in enumerate(runs.items()):
            color = f"C{index}"
            points = [(r["step"], r[metric]) for r in records if metric in r]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            if label in raw:
                ax.plot(steps, values, marker="o", color=color, label=label)
                continue
            ax.plot(steps, smooth(list(values), window), color=color, label=label)
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl)")
    parser.add_argument("--metrics", nargs="+", default=["reward_mean", "rule_score", "kl"])
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--window", type=int, default=5, help="moving-average window (steps)")
    args = parser.parse_args(argv)
    runs = {run.name if run.is_dir() else run.parent.name: read_metrics(run) for run in args.runs}
    plot(runs, args.metrics, args.out, args.window)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
