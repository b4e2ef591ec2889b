"""The one-line JSON summary of scripts/gpu_check.sh, from the logs it wrote.

    python scripts/gpu_check_summary.py LOG_DIR RUN_DIR

Reads ``LOG_DIR/parts.txt`` (name, exit status, seconds and time limit per part), the part logs
in ``RUN_DIR/logs`` and the run directories under ``RUN_DIR``; prints the summary as one JSON
line and writes it to ``LOG_DIR/summary.json``. A part that timed out has exit 124 (``timed_out``
in its entry); a section that cannot be read is named under ``summary_errors``, the rest is
still summarised. Exits 0 when every part that ran passed (on a machine without CUDA only the
test collection runs, and its GPU tests are reported as skipped), 1 otherwise.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def _last_json(path: Path) -> dict | None:
    """The last line of ``path`` that is a JSON object (a benchmark's figures, a metrics
    record); None without one."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.MULTILINE)


def _pytest_counts(logs: list[Path]) -> dict[str, int]:
    """Tests per outcome from ``pytest -v`` logs (the shards'), counted from the per-test lines,
    so a shard cut off by the time limit still counts what it finished (a test's last line wins:
    a teardown error after a pass is an error)."""
    outcomes: dict[str, str] = {}
    for log in logs:
        for node, outcome in _OUTCOME.findall(log.read_text(errors="replace")):
            outcomes[node] = outcome.lower()
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


NCCL_PLACEMENTS = ("flattening", "interleaving", "interleaving2", "separation",
                   "async_separation")
"""The placements the check runs under NCCL with 2 or more GPUs (``nccl_<name>`` run dirs)."""


def _placement_agreement(log_dir: Path) -> dict:
    """Each NCCL run's last metrics, and per synchronous placement the largest difference from
    flattening's per-step ``reward_mean``, ``kl`` and ``policy_loss`` (the same steps, fp32:
    only the reduction order differs; asynchronous separation trains on older rollouts, so it
    is not compared)."""
    runs = {placement: _records(log_dir / f"nccl_{placement}" / "metrics.jsonl")
            for placement in NCCL_PLACEMENTS}
    found = {placement: records for placement, records in runs.items() if records}
    if not found:
        return {}
    result: dict = {}
    for placement, records in found.items():
        last = [record for record in records if "reward_mean" in record][-1:] or records[-1:]
        result[placement] = {key: last[0].get(key) for key in (
            "step", "reward_mean", "kl", "policy_loss", "step_seconds",
            "rollout/logprob_diff_max")}
    reference = [record for record in runs["flattening"] if "reward_mean" in record]
    diffs = {}
    for placement in NCCL_PLACEMENTS[1:-1]:
        steps = [record for record in runs[placement] if "reward_mean" in record]
        if reference and len(steps) == len(reference):
            diffs[placement] = max(abs(a[key] - b[key]) for a, b in zip(reference, steps,
                                                                       strict=True)
                                   for key in ("reward_mean", "kl", "policy_loss"))
    if diffs:
        result["max_abs_diff_from_flattening"] = diffs
        result["max_abs_diff"] = max(diffs.values())
    return result


def _parts(log_dir: Path) -> dict:
    """``parts.txt``: per part its exit status, seconds and time limit, in the order they ran."""
    parts = {}
    path = log_dir / "parts.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, seconds, *limit = line.split()
        parts[name] = {"exit": int(status), "seconds": int(seconds)}
        if limit:
            parts[name]["limit_s"] = int(limit[0])
        if int(status) in (124, 137):  # timeout's status, or killed after its grace period
            parts[name]["timed_out"] = True
    return parts


def summarize(log_dir: Path, run_dir: Path) -> tuple[dict, bool]:
    logs = run_dir / "logs"
    cuda = torch.cuda.is_available()
    summary: dict = {
        "gpu_check": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0, "run_dir": str(run_dir)}
    errors: dict[str, str] = {}

    def section(name: str, read) -> None:
        try:
            value = read()
        except Exception as error:  # noqa: BLE001 - one unreadable log must not lose the rest
            errors[name] = f"{type(error).__name__}: {error}"[:500]
            return
        if value is not None and value != {}:
            summary[name] = value

    section("parts", lambda: _parts(log_dir))
    summary.setdefault("parts", {})
    summary["limits_s_total"] = sum(p.get("limit_s", 0) for p in summary["parts"].values())
    section("gpu_tests", lambda: _pytest_counts(sorted(logs.glob("gpu_tests.*.log"))))
    summary.setdefault("gpu_tests", {})
    if not cuda:
        summary["skipped"] = ("no CUDA device: the gpu tests were collected and skipped; "
                              "run_ppo, the throughput, stage-memory and rollouts benchmarks "
                              "need a GPU")
    for dtype in ("float32", "bfloat16"):
        def last_step(dtype: str = dtype) -> dict | None:
            last = _last_json(run_dir / f"ppo_{dtype}" / "metrics.jsonl")
            return None if last is None else {key: last.get(key) for key in (
                "step", "reward_mean", "kl", "policy_loss", "value_loss", "step_seconds",
                "rollout/logprob_diff_max")}
        section(f"run_ppo_{dtype}", last_step)
    for part in ("throughput", "stage_memory", "rollouts"):
        section(part, lambda part=part: _last_json(logs / f"{part}.log"))
    if cuda and torch.cuda.device_count() < 2:
        summary["skipped"] = "one GPU: the NCCL runs across devices (flattening, separation) " \
                             "need 2 or more"
    section("nccl", lambda: _placement_agreement(run_dir))
    if errors:
        summary["summary_errors"] = errors
    passed = bool(summary["parts"]) and not errors and all(
        part["exit"] == 0 for part in summary["parts"].values())
    if cuda:
        passed = passed and summary["gpu_tests"].get("passed", 0) > 0 and not any(
            summary["gpu_tests"].get(outcome) for outcome in ("failed", "error"))
    summary["passed"] = passed
    return summary, passed


def main() -> None:
    log_dir = Path(sys.argv[1])
    run_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else log_dir
    summary, passed = summarize(log_dir, run_dir)
    line = json.dumps(summary)
    (log_dir / "summary.json").write_text(line + "\n")
    print(line)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
