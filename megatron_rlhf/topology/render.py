"""Show a plan to a person: a text table and an SVG picture (hand-built, no extra dependency).

    print(format_summary(plan)); print(format_table(plan))
    Path("plan.svg").write_text(render_svg(plan))

The picture has one row per node and one cell per device; inside a cell, one lane per model
(always the same lane for the same model), coloured when the device holds that model and labelled
with the device's pipeline stage and data-parallel index. Each TP group is outlined.
"""

from __future__ import annotations

from html import escape

from megatron_rlhf.topology.plan import PlacementPlan

ROLE_COLOURS = {
    "actor": "#4e79a7",
    "critic": "#f28e2b",
    "ref": "#59a14f",
    "reward": "#e15759",
    "shadow_actor": "#a0cbe8",
    "shadow_critic": "#ffbe7d",
}

_CELL_W = 78
_LANE_H = 15
_HEAD_H = 14
_GAP = 6
_LABEL_W = 150
_LEGEND_LINE = 18


def format_summary(plan: PlacementPlan) -> str:
    """One line per model: ranks, devices, tp/pp/dp, pools and the rough memory of its states
    per device (weights, gradients and optimizer state: ``ModelSpec.gib_per_device``)."""
    pools = ", ".join(f"{p.kind} {p.nodes}x{p.devices_per_node}" for p in plan.cluster.pools)
    lines = [
        f"placement {plan.config.strategy} on {plan.cluster.num_nodes} nodes "
        f"({plan.world_size} devices): {pools}",
        f"{'role':<14} {'ranks':<14} {'devices':>7} {'tp':>3} {'pp':>3} {'dp':>4}  "
        f"{'arch':<10} {'states GiB':>10}  pools",
    ]
    for role in plan.roles:
        model = plan[role]
        kinds = ",".join(plan.cluster.pools[i].kind for i in plan.pools_of(role))
        ranks = f"[{model.ranks.start}, {model.ranks.stop})"
        lines.append(
            f"{role:<14} {ranks:<14} {model.size:>7} {model.tp:>3} {model.pp:>3} {model.dp:>4}  "
            f"{model.spec.arch.name:<10} {model.spec.gib_per_device(model.dp):>10.1f}  {kinds}"
        )
    return "\n".join(lines)


def format_table(plan: PlacementPlan) -> str:
    """One line per device: node, local device, rank, pool, then ``tp/pp/dp`` ranks per model."""
    roles = plan.roles
    width = max(12, *(len(role) for role in roles))
    header = f"{'node':>4} {'dev':>3} {'rank':>5}  {'pool':<12}" + "".join(
        f" {role:<{width}}" for role in roles
    )
    lines = [header + f" {'GiB':>6}"]
    for rank in range(plan.world_size):
        where = plan.cluster.locate(rank)
        line = f"{where.node:>4} {where.local_rank:>3} {rank:>5}  " \
               f"{plan.cluster.pools[where.pool_index].kind:<12}"
        for role in roles:
            model = plan[role]
            cell = "-"
            if model.holds(rank):
                c = model.coords(rank)
                cell = f"t{c.tp} p{c.pp} d{c.dp}"
            line += f" {cell:<{width}}"
        lines.append(line + f" {plan.gib_on(rank):>6.1f}")
    return "\n".join(lines)


def render_svg(plan: PlacementPlan, title: str | None = None) -> str:
    """The plan as an SVG document: nodes as rows, devices as cells, TP groups outlined.

    Args:
        plan: the plan to draw.
        title: heading; defaults to the strategy and cluster shape.
    """
    roles = plan.roles
    nodes = plan.cluster.nodes()
    row_h = _HEAD_H + len(roles) * _LANE_H + _GAP
    legend_h = (len(roles) + 3) * _LEGEND_LINE
    width = _LABEL_W + max(node.size for node in nodes) * _CELL_W + _GAP
    height = legend_h + len(nodes) * row_h + _GAP
    title = title or (f"{plan.config.strategy}: "
                      + " + ".join(f"{p.nodes}x{p.devices_per_node} {p.kind}"
                                   for p in plan.cluster.pools))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{_GAP}" y="{_LEGEND_LINE}" font-size="14" font-weight="bold">'
        f"{escape(title)}</text>",
    ]
    parts += _legend(plan)
    top = legend_h
    for node in nodes:
        y = top + node.index * row_h
        kind = plan.cluster.pools[node.pool_index].kind
        parts.append(f'<text x="{_GAP}" y="{y + _HEAD_H + _LANE_H}" font-size="12">'
                     f"node {node.index} ({escape(kind)})</text>")
        for local, rank in enumerate(node.ranks):
            parts += _cell(plan, rank, _LABEL_W + local * _CELL_W, y)
    parts += _tp_outlines(plan, top, row_h)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _legend(plan: PlacementPlan) -> list[str]:
    parts = []
    for i, role in enumerate(plan.roles):
        model = plan[role]
        y = (i + 2) * _LEGEND_LINE
        parts.append(f'<rect x="{_GAP}" y="{y - 11}" width="24" height="12" '
                     f'fill="{ROLE_COLOURS[role]}" stroke="black" stroke-width="0.5"/>')
        parts.append(
            f'<text x="{_GAP + 30}" y="{y}" font-size="12">{role}: {model.spec.arch.name}, '
            f"tp {model.tp} pp {model.pp} dp {model.dp}, ranks [{model.ranks.start}, "
            f"{model.ranks.stop}), ~{model.spec.gib_per_device(model.dp):.1f} GiB/device"
            f"{' (trainable)' if model.spec.trainable else ''}</text>"
        )
    note_y = (len(plan.roles) + 2) * _LEGEND_LINE
    parts.append(f'<text x="{_GAP}" y="{note_y}" font-size="11" fill="#333">black frames: TP '
                 "groups; in a lane, p = pipeline stage, d = data-parallel index</text>")
    return parts


def _cell(plan: PlacementPlan, rank: int, x: int, y: int) -> list[str]:
    """One device: its frame, its rank, and one lane per role."""
    inner = _CELL_W - 4
    parts = [
        f'<rect x="{x}" y="{y}" width="{inner + 2}" height="{_HEAD_H + len(plan.roles) * _LANE_H}"'
        ' fill="#f4f4f4" stroke="#999" stroke-width="0.5"/>',
        f'<text x="{x + 3}" y="{y + 11}" font-size="10" fill="#333">rank {rank}</text>',
    ]
    for lane, role in enumerate(plan.roles):
        model = plan[role]
        if not model.holds(rank):
            continue
        coords = model.coords(rank)
        lane_y = y + _HEAD_H + lane * _LANE_H
        parts.append(f'<rect x="{x + 1}" y="{lane_y}" width="{inner}" height="{_LANE_H - 1}" '
                     f'fill="{ROLE_COLOURS[role]}"/>')
        parts.append(f'<text x="{x + 4}" y="{lane_y + 11}" font-size="9">'
                     f"{_short(role)} p{coords.pp} d{coords.dp}</text>")
    return parts


def _tp_outlines(plan: PlacementPlan, top: int, row_h: int) -> list[str]:
    """A frame around the lane cells of every TP group (consecutive devices of one node)."""
    parts = []
    for lane, role in enumerate(plan.roles):
        model = plan[role]
        if model.tp == 1:
            continue
        for group in model.group_ranks("tp"):
            where = plan.cluster.locate(group[0])
            x = _LABEL_W + where.local_rank * _CELL_W
            y = top + where.node * row_h + _HEAD_H + lane * _LANE_H
            parts.append(
                f'<rect x="{x}" y="{y - 0.5}" width="{len(group) * _CELL_W - 2}" '
                f'height="{_LANE_H}" fill="none" stroke="black" stroke-width="1.5"/>'
            )
    return parts


def _short(role: str) -> str:
    return role.replace("shadow_", "s.")
