"""Draw a run's per-rank timeline (Chrome trace JSON) as a pipeline-bubble PNG.

    torchrun --nproc-per-node 4 tools/run_ppo.py --placement separation trace=true \\
        rollout.async_rollout=true --run-dir runs/sep_async
    python tools/plot_timeline.py runs/sep_async/timeline.json --out sep_async.png

Ranks are rows, stages coloured bars; white space is idle time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

STAGE_COLOURS = {
    "generate": "#4c72b0", "experience": "#55a868", "advantages": "#8172b2",
    "train": "#c44e52", "sync_weights": "#ccb974", "transfer": "#b0b0b0",
}


def load_events(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file."""
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def plot(events: list[dict], title: str, out: Path) -> None:
    """Write the timeline picture of ``events`` to ``out``."""
    ranks = sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.5))
    for event in sorted(events, key=lambda e: e["dur"], reverse=True):
        colour = STAGE_COLOURS.get(event["cat"], "#dddddd")
        ax.barh(event["pid"], event["dur"] / 1e6, left=event["ts"] / 1e6, height=0.7,
                color=colour, edgecolor="black", linewidth=0.2)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=s) for s, c in STAGE_COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(STAGE_COLOURS))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="timeline.json written by a traced run")
    parser.add_argument("--out", type=Path, help="PNG path (default: next to the trace)")
    parser.add_argument("--title", help="figure title (default: the trace's directory name)")
    args = parser.parse_args(argv)
    out = args.out or args.trace.with_suffix(".png")
    plot(load_events(args.trace), args.title or args.trace.parent.name, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
