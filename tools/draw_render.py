"""Render a :class:`draftgraph.tools.draw_layout.Layout` with matplotlib (1 data unit = 1 inch).

Boxes: name (bold), op, and tags for the inputs (``i``), weights (``w``) and state
(``s``) the node reads, numbered in order of first use and spelled out in the
legend on the right; a graph output has a thick border and an ``out`` tag.
"""

from __future__ import annotations

from pathlib import Path

from draftgraph.runtime.ir.graph import ValueKind
from draftgraph.tools.colors import KIND_COLORS, family_color, node_family
from draftgraph.tools.draw_layout import BOX_H, BOX_W, Layout, short_name

LEGEND_W = 3.9
TAG_PREFIX = {ValueKind.INPUT: "i", ValueKind.WEIGHT: "w", ValueKind.STATE: "s"}
PT = 1 / 72  # inches per point
MONO_W = 0.6  # width of a monospace glyph, in ems


def tag_numbers(graph, order) -> dict[str, str]:
    """Value name -> ``i3`` / ``w12`` / ``s1``, numbered by first use in ``order``."""
    counts = {k: 0 for k in TAG_PREFIX}
    tags: dict[str, str] = {}
    for name in list(graph.inputs) + [i for n in order for i in graph.nodes[n].inputs]:
        value = graph.values[name]
        if value.kind in TAG_PREFIX and name not in tags:
            counts[value.kind] += 1
            tags[name] = f"{TAG_PREFIX[value.kind]}{counts[value.kind]}"
    return tags


def compress_tags(tags: list[str]) -> list[str]:
    """``[w7, w8, w9, s1]`` -> ``[w7-9, s1]``: runs of three or more consecutive tags of one kind."""
    out: list[str] = []
    i = 0
    while i < len(tags):
        j = i
        while (
            j + 1 < len(tags)
            and tags[j + 1][0] == tags[i][0]
            and int(tags[j + 1][1:]) == int(tags[j][1:]) + 1
        ):
            j += 1
        if j - i >= 2:
            out.append(f"{tags[i]}-{tags[j][1:]}")
        else:
            out.extend(tags[i : j + 1])
        i = j + 1
    return out


def render_layout(graph, layout: Layout, out: Path, dpi: int = 110) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from draftgraph.runtime.ir.schedule import schedule
    from matplotlib.patches import FancyBboxPatch, Rectangle

    order = [n.name for n in schedule(graph)]
    tags = tag_numbers(graph, order)
    width, height = layout.width + LEGEND_W, max(layout.height, 9.0) + 0.2
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")

    title = f"{graph.name}: {len(graph.nodes)} nodes, {len(graph.weights)} weights, {len(graph.state)} state"
    ax.text(0.4, 0.35, title, fontsize=13, fontweight="bold", va="center")

    for scope, x0, y0, x1, y1 in layout.clusters:
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                boxstyle="round,pad=0,rounding_size=0.12",
                facecolor="#f1f1f7",
                edgecolor="#9a9ab0",
                linewidth=1.0,
                zorder=0,
            )
        )
        ax.text(
            x0 + 0.1,
            y0 + 0.13,
            scope,
            fontsize=8.5,
            fontweight="bold",
            color="#55556a",
            va="center",
            zorder=1,
        )

    for edge in layout.edges:
        xs, ys = zip(*edge.points)
        ax.plot(xs, ys, color="#555555", linewidth=0.9, zorder=2, solid_joinstyle="miter")
        (x_a, y_a), (x_b, y_b) = edge.points[-2], edge.points[-1]
        ax.annotate(
            "",
            xy=(x_b, y_b),
            xytext=(x_a, y_a),
            zorder=2,
            arrowprops={
                "arrowstyle": "-|>",
                "color": "#555555",
                "lw": 0.9,
                "shrinkA": 0,
                "shrinkB": 0,
                "mutation_scale": 9,
            },
        )
        if edge.label:
            ax.text(
                *edge.label_at,
                edge.label,
                fontsize=6.5,
                family="monospace",
                ha="center",
                va="center",
                rotation=edge.label_rotation,
                color="#333333",
                zorder=3,
                bbox={"boxstyle": "round,pad=0.12", "facecolor": "white", "edgecolor": "none", "alpha": 0.9},
            )

    outputs = set(graph.outputs)
    for name, box in layout.boxes.items():
        node = graph.nodes[name]
        color = family_color(node_family(node.op))
        is_output = any(o in outputs for o in node.outputs)
        ax.add_patch(
            FancyBboxPatch(
                (box.x - BOX_W / 2, box.y - BOX_H / 2),
                BOX_W,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=0.08",
                facecolor=color,
                edgecolor="#222222",
                linewidth=2.2 if is_output else 0.8,
                zorder=4,
            )
        )
        ax.text(
            box.x,
            box.y - 0.17,
            short_name(name, node.scope),
            fontsize=8.5,
            fontweight="bold",
            ha="center",
            va="center",
            zorder=5,
        )
        ax.text(
            box.x,
            box.y + 0.01,
            node.op,
            fontsize=7,
            style="italic",
            color="#333333",
            ha="center",
            va="center",
            zorder=5,
        )
        chips = compress_tags([tags[i] for i in dict.fromkeys(node.inputs) if i in tags])
        if is_output:
            chips.append("out")
        _draw_chips(ax, box.x, box.y + 0.19, chips)

    _draw_legend(ax, graph, tags, layout.width + 0.1, Rectangle)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def _chip_color(chip: str) -> str:
    return {"i": KIND_COLORS["input"], "w": KIND_COLORS["weight"], "s": KIND_COLORS["state"]}.get(
        chip[0], KIND_COLORS["output"]
    )


def _draw_chips(ax, x_center: float, y: float, chips: list[str], size: float = 6.5) -> None:
    widths = [(len(c) * MONO_W * size + 5) * PT for c in chips]
    x = x_center - (sum(widths) + 0.05 * (len(chips) - 1)) / 2
    for chip, w in zip(chips, widths):
        ax.text(
            x + w / 2,
            y,
            chip,
            fontsize=size,
            family="monospace",
            ha="center",
            va="center",
            zorder=6,
            bbox={
                "boxstyle": "round,pad=0.12",
                "facecolor": _chip_color(chip),
                "edgecolor": "#666666",
                "linewidth": 0.5,
            },
        )
        x += w + 0.05


def _draw_legend(ax, graph, tags: dict[str, str], x0: float, Rectangle) -> None:
    y = 0.8
    ax.text(x0, y, "op families", fontsize=9, fontweight="bold", va="center")
    y += 0.25
    families = sorted({node_family(n.op) for n in graph.nodes.values()})
    for i, family in enumerate(families):
        cx, cy = x0 + (i % 2) * 1.8, y + (i // 2) * 0.22
        ax.add_patch(
            Rectangle(
                (cx, cy - 0.08), 0.3, 0.16, facecolor=family_color(family), edgecolor="#222222", linewidth=0.6
            )
        )
        ax.text(cx + 0.38, cy, family, fontsize=7.5, va="center")
    y += ((len(families) + 1) // 2) * 0.22 + 0.2
    ax.text(
        x0,
        y,
        "tags: i input, w weight, s state; thick border / out = graph output",
        fontsize=7,
        va="center",
        color="#333333",
    )
    y += 0.3
    for kind, heading in (
        (ValueKind.INPUT, "inputs"),
        (ValueKind.WEIGHT, "weights"),
        (ValueKind.STATE, "state"),
    ):
        named = [(tag, name) for name, tag in tags.items() if graph.values[name].kind == kind]
        if not named:
            continue
        ax.text(x0, y, heading, fontsize=9, fontweight="bold", va="center")
        y += 0.22
        for tag, name in named:
            _draw_chips(ax, x0 + 0.2, y, [tag])
            ax.text(
                x0 + 0.45,
                y,
                f"{graph.values[name].ref} {graph.values[name].spec.short()}",
                fontsize=6.5,
                family="monospace",
                va="center",
            )
            y += 0.17
        y += 0.15
