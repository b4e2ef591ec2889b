"""Hardware profiles: shipped specification numbers, validation, pool lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.planner import (
    HardwareProfile,
    homogeneous_cluster,
    load_profile,
    resolve_profiles,
    shipped_profiles,
)
from megatron_rlhf.topology import ClusterSpec


def test_shipped_profiles_carry_the_spec_sheet_numbers() -> None:
    profiles = shipped_profiles()
    assert set(profiles) == {"A100-80GB", "H100-80GB", "H200-141GB", "V100-32GB"}
    a100 = profiles["A100-80GB"]
    assert (a100.peak_tflops, a100.hbm_gb_per_s, a100.memory_gib) == (312, 2039, 80)
    assert profiles["H200-141GB"].hbm_gb_per_s == 4800
    assert all(profile.source for profile in profiles.values())


def test_host_figures_price_and_bound_optimizer_offload() -> None:
    a100 = load_profile("A100-80GB")
    # A DGX A100 node: 2 TiB of host memory, 90% of it usable; Adam at 1e9 parameters/s.
    assert a100.host_usable_bytes == 2048 * 1024**3 * 0.9
    assert a100.host_adam_params_per_s == 1e9
    assert load_profile("V100-32GB").host_memory_gib == 512
    unknown = HardwareProfile.from_dict({**a100.to_dict(), "host_memory_gib": 0})
    assert unknown.host_usable_bytes == 0
    with pytest.raises(ValueError, match="host_adam_gparams_per_s=0 must be positive"):
        HardwareProfile.from_dict({**a100.to_dict(), "host_adam_gparams_per_s": 0})


def test_load_by_name_or_path_and_round_trip(tmp_path: Path) -> None:
    assert load_profile("h100-80gb").peak_tflops == 989
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**load_profile("V100-32GB").to_dict(), "name": "mine"}))
    assert load_profile(path).name == "mine"
    with pytest.raises(ValueError, match="tools/calibrate.py"):
        load_profile(tmp_path / "missing.json")


def test_invalid_profiles_name_the_field() -> None:
    base = load_profile("A100-80GB").to_dict()
    with pytest.raises(ValueError, match="peak_tflops=0 must be positive"):
        HardwareProfile.from_dict({**base, "peak_tflops": 0})
    with pytest.raises(ValueError, match="compute_efficiency=1.5 must be in"):
        HardwareProfile.from_dict({**base, "compute_efficiency": 1.5})
    with pytest.raises(ValueError, match="unknown keys"):
        HardwareProfile.from_dict({**base, "tflops": 1})


def test_pools_find_their_profile() -> None:
    cluster = homogeneous_cluster("H200-141GB", 2, 8)
    assert cluster.pools[0].memory_gib == 141 and cluster.pools[0].inter_node_gbps == 3200
    assert resolve_profiles(cluster)[0].name == "H200-141GB"
    unknown = ClusterSpec.homogeneous(1, 8, kind="MI300X")
    with pytest.raises(ValueError, match="has no hardware profile"):
        resolve_profiles(unknown)
    assert resolve_profiles(unknown, load_profile("H100-80GB"))[0].name == "H100-80GB"
