"""The one-line JSON summary of scripts/gpu_check.sh, from the logs it wrote.

    python scripts/gpu_check_summary.py LOG_DIR RUN_DIR

Reads ``LOG_DIR/parts.txt`` (name, exit status, seconds, time limit and side-by-side group per
part), the part logs in ``RUN_DIR/logs`` and the run directories under ``RUN_DIR``; prints the
summary as one JSON line and writes it to ``LOG_DIR/summary.json``. Each part has an entry of its
own: a run's last step with its ``throughput/*`` metrics, the MoE run's line about CUDA graphs,
the multi-turn counts, the re-planning's moves, ``te`` skipped without Transformer Engine. A part
that timed out has exit 124 (``timed_out`` in its entry); a section that cannot be read is named
under ``summary_errors``, the rest is still summarised. Exits 0 when every part that ran passed (on a machine without CUDA only the
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


THROUGHPUT = ("throughput/tokens_per_s_per_device", "throughput/train_mfu",
              "throughput/generate_mfu")
"""The per-step throughput metrics (the step's all-reduce over the world), in each run's entry."""


def _last_step(run_dir: Path, keys: tuple[str, ...]) -> dict | None:
    """``keys`` of the last record of ``run_dir/metrics.jsonl`` (with the throughput metrics);
    None without one."""
    last = _last_json(run_dir / "metrics.jsonl")
    return None if last is None else {key: last.get(key) for key in ("step", *keys, *THROUGHPUT)}


def _log_lines(log: Path, pattern: str) -> list[str]:
    """The lines of ``log`` that match ``pattern``, without the logger's ``[time rank level
    name]`` prefix, 300 characters at most each."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return [re.sub(r"^\[[^]]*\] ", "", line)[:300] for line in lines if re.search(pattern, line)]


def _moe(run_dir: Path, logs: Path) -> dict | None:
    """The MoE run at ep 1: its last step and what it logged about CUDA graphs (under
    ``generation.cuda_graphs: auto`` MoE decodes eagerly and says so once)."""
    last = _last_step(run_dir / "moe_ep1", ("reward_mean", "kl", "policy_loss"))
    if last is None:
        return None
    return {**last, "cuda_graphs": _log_lines(logs / "moe_ep1.log", r"(?i)cuda.?graphs")[:3]}


def _multi_turn(run_dir: Path) -> dict | None:
    """The multi-turn run's last step: turns per episode, the environment's answers."""
    return _last_step(run_dir / "multi_turn", (
        "reward_mean", "kl", "rollout/turns", "rollout/observation_tokens", "rollout/truncated",
        "rollout/environment_reward", "response_length"))


def _te(run_dir: Path, logs: Path) -> dict | None:
    """The Transformer Engine part: skipped without TE, else the models' layers and the step."""
    if _log_lines(logs / "te.log", r"^skipped: transformer_engine not installed"):
        return {"skipped": "transformer_engine not installed"}
    last = _last_step(run_dir / "te", ("reward_mean", "kl"))
    layers = _log_lines(logs / "te.log", r"\] layers: ")
    if last is None and not layers:
        return None
    return {**(last or {}), "layers": layers[0].removeprefix("layers: ") if layers else None}


def _replan(run_dir: Path) -> dict | None:
    """The re-planning run: how often it re-planned, each move (forced) with its seconds, the
    last ranking's verdict and the last step."""
    path = run_dir / "replan" / "plan_history.jsonl"
    lines = _records(path)
    last = _last_step(run_dir / "replan", ("replan/predicted_gain", "replan/move_seconds"))
    if not lines and last is None:
        return None
    rankings = [line for line in lines if "ranking" in line]
    moves = [{"after_step": line["step"], **{key: line["moved"].get(key) for key in (
        "from", "to", "forced", "state", "move_seconds")}} for line in lines if "moved" in line]
    result: dict = {"replans": len(rankings), "moves": moves, "last_step": last}
    if rankings:
        result["last_ranking"] = {key: rankings[-1].get(key) for key in (
            "step", "current", "best", "predicted_gain", "would_move")}
    return result


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
    """``parts.txt``: per part its exit status, seconds, time limit and, for parts run side by
    side, their group (``side_by_side:N``), in the order they finished."""
    parts = {}
    path = log_dir / "parts.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, seconds, *rest = line.split()
        parts[name] = {"exit": int(status), "seconds": int(seconds)}
        if rest:
            parts[name]["limit_s"] = int(rest[0])
        if rest[1:]:
            parts[name]["side_by_side"] = int(rest[1].removeprefix("side_by_side:"))
        if int(status) in (124, 137):  # timeout's status, or killed after its grace period
            parts[name]["timed_out"] = True
    return parts


def _limits_total(parts: dict) -> int:
    """The longest the parts could have taken: every limit, but of the parts run side by side
    only each group's largest."""
    groups: dict = {}
    for name, part in parts.items():
        key = part.get("side_by_side", name)
        groups[key] = max(groups.get(key, 0), part.get("limit_s", 0))
    return sum(groups.values())


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
    summary["limits_s_total"] = _limits_total(summary["parts"])
    section("gpu_tests", lambda: _pytest_counts(sorted(logs.glob("gpu_tests.*.log"))))
    summary.setdefault("gpu_tests", {})
    if not cuda:
        summary["skipped"] = ("no CUDA device: the gpu tests were collected and skipped; "
                              "run_ppo, moe_ep1, multi_turn, te, replan, the throughput, "
                              "stage-memory and rollouts benchmarks need a GPU")
    for dtype in ("float32", "bfloat16"):
        section(f"run_ppo_{dtype}", lambda dtype=dtype: _last_step(run_dir / f"ppo_{dtype}", (
            "reward_mean", "kl", "policy_loss", "value_loss", "step_seconds",
            "rollout/logprob_diff_max")))
    section("moe_ep1", lambda: _moe(run_dir, logs))
    section("multi_turn", lambda: _multi_turn(run_dir))
    section("te", lambda: _te(run_dir, logs))
    section("replan", lambda: _replan(run_dir))
    for part in ("throughput", "stage_memory", "rollouts"):
        section(part, lambda part=part: _last_json(logs / f"{part}.log"))
    if cuda and torch.cuda.device_count() < 2:
        summary["skipped"] = ("one GPU: the NCCL runs across devices (flattening, separation) "
                              "need 2 or more; replan moved at world size 1, to the same "
                              "placement")
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
