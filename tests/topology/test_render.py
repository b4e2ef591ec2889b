"""The table, the SVG picture and the plan_placement CLI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_rlhf.topology import PlacementConfig, plan_placement
from megatron_rlhf.topology.render import format_summary, format_table, render_svg
from tests.scripts import load_script
from tests.topology.helpers import CLUSTERS, HETERO


def _tool():
    return load_script("tools/plan_placement.py")


def test_table_lists_every_device_with_its_grid_ranks() -> None:
    plan = plan_placement(CLUSTERS["1x8"], PlacementConfig("interleaving", tp=2), "tiny")
    lines = format_table(plan).splitlines()
    assert len(lines) == 1 + 8
    assert lines[0].split()[:7] == ["node", "dev", "rank", "pool", "actor", "critic", "ref"]
    assert lines[6].split()[:4] == ["0", "5", "5", "A100-80GB"]
    assert "t1 p0 d2" in lines[6] and "t1 p0 d0" in lines[6]  # actor dp 2, reward dp 0
    summary = format_summary(plan)
    assert "placement interleaving on 1 nodes (8 devices)" in summary
    assert "reward         [4, 8)" in summary


def test_svg_has_a_row_per_node_a_cell_per_device_and_tp_outlines() -> None:
    plan = plan_placement(HETERO, PlacementConfig("hetero-separation", tp=4), "llama-7b")
    root = ET.fromstring(render_svg(plan))
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert sum(text.startswith("node ") for text in texts) == 3
    assert sum(text.startswith("rank ") for text in texts) == 16
    outlines = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")
                if r.get("fill") == "none"]
    tp_groups = sum(plan[role].size // plan[role].tp for role in plan.roles)
    assert len(outlines) == tp_groups


def test_cli_prints_table_json_and_writes_svg(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    svg = tmp_path / "plan.svg"
    tool.main(["--nodes", "16", "--gpus-per-node", "8", "--placement", "separation", "--tp", "8",
               "--model", "llama-65b", "--svg", str(svg)])
    out = capsys.readouterr().out
    assert "shadow_actor   [64, 128)" in out and len(out.splitlines()) > 128
    assert svg.read_text().startswith("<svg")
    tool.main(["--pool", "A100-80GB:1x8:80:1.0", "--pool", "V100-32GB:2x4:32:0.4",
               "--placement", "hetero-separation", "--tp", "4", "--json",
               "--set", "shadow_actor.tp=2"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 16 and plan["models"]["shadow_actor"]["tp"] == 2
    tool.main(["--nodes", "1", "--gpus-per-node", "4", "--placement", "1,1,0.5,0.5",
               "--model", "tiny", "--ac-share", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["placement"]["strategy"] == "custom" and "critic" not in plan["models"]


def test_cli_refusal_exits_2_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _tool().main(["--nodes", "2", "--gpus-per-node", "8", "--tp", "16",
                      "--model", "llama-65b"])
    assert exit_info.value.code == 2
    assert "choose tp in {1,2,4,8}" in capsys.readouterr().err
