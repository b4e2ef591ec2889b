"""Check that a run of the GPU check wrote every step's record with the metrics it must have
(scripts/gpu_check.sh runs it after each ``tools/run_ppo.py`` part, so a run that crashes at the
end of a step, or one whose step drops a metric, fails its part).

    python scripts/gpu_check_metrics.py RUN_DIR STEPS [KEY ...]

RUN_DIR/metrics.jsonl must hold the records of steps 0 to STEPS-1, each with every KEY (default:
``throughput/tokens_per_s_per_device``, which the step's all-reduce over the world gives) as a
finite number. Exit status: 0 when it does, 1 otherwise (the problems on stderr).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REQUIRED = ("throughput/tokens_per_s_per_device",)


def problems(run_dir: Path, steps: int, keys: tuple[str, ...] = REQUIRED) -> list[str]:
    """What is wrong with ``run_dir/metrics.jsonl`` for a run of ``steps`` steps; [] if
    nothing."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return [f"{path}: missing (the run wrote no step)"]
    records = {}
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if "step" in record and record["step"] < steps:  # the last evaluation's is numbered steps
            records[record["step"]] = record
    found = [f"step {step}: no record" for step in range(steps) if step not in records]
    for step, record in sorted(records.items()):
        for key in keys:
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                    value):
                found.append(f"step {step}: {key}={value!r} (a finite number expected)")
    return found


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[1].isdigit():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 1
    found = problems(Path(argv[0]), int(argv[1]), tuple(argv[2:]) or REQUIRED)
    for problem in found:
        print(f"gpu_check_metrics: {argv[0]}: {problem}", file=sys.stderr)
    if not found:
        print(f"gpu_check_metrics: {argv[0]}: {argv[1]} steps, each with "
              f"{', '.join(argv[2:]) or ', '.join(REQUIRED)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
