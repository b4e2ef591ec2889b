"""A move keeps the trained shards in memory only where the host can hold them twice: the memory
it counts is no more than the memory cgroup leaves, as in a container."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.engine.run import move


def _files(tmp_path: Path, limit: str, usage: str) -> tuple[tuple[str, str], ...]:
    (tmp_path / "memory.max").write_text(f"{limit}\n")
    (tmp_path / "memory.current").write_text(f"{usage}\n")
    return ((str(tmp_path / "missing.max"), str(tmp_path / "missing.current")),
            (str(tmp_path / "memory.max"), str(tmp_path / "memory.current")))


def test_the_cgroup_leaves_its_limit_less_its_usage(tmp_path: Path) -> None:
    assert move.cgroup_headroom_bytes(_files(tmp_path, "8000", "4500")) == 3500
    assert move.cgroup_headroom_bytes(_files(tmp_path, "4000", "4500")) == 0


def test_no_cgroup_limit_leaves_the_hosts_memory(tmp_path: Path) -> None:
    assert move.cgroup_headroom_bytes(_files(tmp_path, "max", "4500")) is None
    assert move.cgroup_headroom_bytes(()) is None


def test_available_memory_is_the_smaller_of_host_and_cgroup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(move, "cgroup_headroom_bytes", lambda: None)
    unlimited = move.available_host_bytes()
    assert unlimited > 0
    monkeypatch.setattr(move, "cgroup_headroom_bytes", lambda: 1234)
    assert move.available_host_bytes() == 1234
    monkeypatch.setattr(move, "cgroup_headroom_bytes", lambda: unlimited * 4)
    # MemAvailable moves a little between the calls; the cgroup's headroom is not taken.
    assert move.available_host_bytes() < unlimited * 2
