"""The one-line JSON summary of scripts/gpu_check.sh, from the logs it wrote.

    python scripts/gpu_check_summary.py LOG_DIR

Exits 0 when every part that ran passed (on a machine without CUDA only the test collection
runs, and its GPU tests are reported as skipped), 1 otherwise.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def _last_json(path: Path) -> dict | None:
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in reversed(lines):
        if line.startswith("{"):
            return json.loads(line)
    return None


def _pytest_counts(log: Path) -> dict[str, int]:
    text = log.read_text() if log.is_file() else ""
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)
    return {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in found}


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def _placement_agreement(log_dir: Path) -> dict:
    """Each NCCL run's last metrics, and the largest difference between the placements' per-step
    ``reward_mean``, ``kl`` and ``policy_loss`` (the same steps, fp32: only the reduction order
    differs)."""
    runs = {placement: _records(log_dir / f"nccl_{placement}" / "metrics.jsonl")
            for placement in ("flattening", "separation")}
    found = {placement: records for placement, records in runs.items() if records}
    if not found:
        return {}
    result: dict = {}
    for placement, records in found.items():
        last = [record for record in records if "reward_mean" in record][-1:] or records[-1:]
        result[placement] = {key: last[0].get(key) for key in (
            "step", "reward_mean", "kl", "policy_loss", "step_seconds")}
    steps = [(a, b) for a, b in zip(runs["flattening"], runs["separation"], strict=False)
             if "reward_mean" in a and "reward_mean" in b]  # evaluation-only records have none
    if len(found) == 2 and len(runs["flattening"]) == len(runs["separation"]) and steps:
        result["max_abs_diff"] = max(abs(a[key] - b[key]) for a, b in steps
                                     for key in ("reward_mean", "kl", "policy_loss"))
    return result


def summarize(log_dir: Path) -> tuple[dict, bool]:
    parts = {}
    for line in (log_dir / "parts.txt").read_text().splitlines():
        name, status, seconds = line.split()
        parts[name] = {"exit": int(status), "seconds": int(seconds)}
    summary: dict = {
        "gpu_check": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "parts": parts,
        "gpu_tests": _pytest_counts(log_dir / "gpu_tests.log"),
    }
    if not torch.cuda.is_available():
        summary["skipped"] = ("no CUDA device: the gpu tests were collected and skipped; "
                              "run_ppo, the throughput, stage-memory and rollouts benchmarks "
                              "need a GPU")
    for dtype in ("float32", "bfloat16"):
        last = _last_json(log_dir / f"ppo_{dtype}" / "metrics.jsonl")
        if last is not None:
            summary[f"run_ppo_{dtype}"] = {key: last.get(key) for key in (
                "step", "reward_mean", "kl", "policy_loss", "value_loss", "step_seconds")}
    for part in ("throughput", "stage_memory", "rollouts"):
        figures = _last_json(log_dir / f"{part}.log")
        if figures is not None:
            summary[part] = figures
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        summary["skipped"] = "one GPU: the NCCL runs across devices (flattening, separation) " \
                             "need 2 or more"
    nccl = _placement_agreement(log_dir)
    if nccl:
        summary["nccl"] = nccl
    passed = all(part["exit"] == 0 for part in parts.values())
    if torch.cuda.is_available():
        passed = passed and summary["gpu_tests"].get("passed", 0) > 0
    summary["passed"] = passed
    return summary, passed


def main() -> None:
    summary, passed = summarize(Path(sys.argv[1]))
    print(json.dumps(summary))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
