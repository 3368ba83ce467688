"""Graphviz DOT of a graph: op nodes as boxes, weights and state apart, edges labelled by type."""

from __future__ import annotations

from collections.abc import Mapping

from draftgraph.runtime.ir.graph import Graph, Node, ValueKind
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.schedule import flatten


def _quote(text: str) -> str:
    """A DOT string. Labels carry DOT's own ``\\n`` line breaks, so only quotes are escaped."""
    return '"' + text.replace('"', '\\"') + '"'


def to_dot(graph: Graph, offsets: Mapping[str, int] | None = None, colors: Mapping[str, str] | None = None) -> str:
    """Graphviz DOT: op nodes as boxes, weights and state apart, edges labelled dtype[shape].

    Nodes of one scope (e.g. ``d0.body``) are drawn as a labelled cluster. ``offsets`` (a plan's
    arena offset per value) adds each node's first output offset to its label.
    """
    flat = flatten(graph)
    colors = colors or {}
    lines = [f"digraph {_quote(flat.name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
    lines.append('  edge [fontname="Helvetica", fontsize=8];')
    by_scope: dict[str, list[Node]] = {}
    for node in flat.nodes.values():
        by_scope.setdefault(node.scope, []).append(node)
    for scope, nodes in by_scope.items():
        indent = "  "
        if scope:
            lines.append(f"  subgraph {_quote('cluster_' + scope)} {{")
            lines.append(f'    label={_quote(scope)}; style="rounded,filled"; fillcolor="#f4f4f8";')
            indent = "    "
        for node in nodes:
            family = get_op(node.op).family
            color = colors.get(family, "#dddddd")
            label = node.name.rsplit(".", 1)[-1] + "\\n" + node.op
            if offsets is not None and node.outputs and node.outputs[0] in offsets:
                label += f"\\n+{offsets[node.outputs[0]]:#x}"
            lines.append(
                f'{indent}{_quote("n:" + node.name)} [label={_quote(label)}, shape=box, style="rounded,filled", '
                f"fillcolor={_quote(color)}];"
            )
        if scope:
            lines.append("  }")
    for value in flat.values.values():
        if value.kind == ValueKind.INTERMEDIATE:
            continue
        shape = {"weight": "note", "state": "cylinder", "input": "ellipse"}[value.kind.value]
        fill = {"weight": "#fff3c4", "state": "#ffd6d6", "input": "#d6f5d6"}[value.kind.value]
        label = f"{value.ref}\\n{value.spec.short()}"
        lines.append(
            f'  {_quote("v:" + value.name)} [label={_quote(label)}, shape={shape}, style=filled, '
            f"fillcolor={_quote(fill)}];"
        )
    for node in flat.nodes.values():
        for name in node.inputs:
            value = flat.values[name]
            src = "v:" + name if value.kind != ValueKind.INTERMEDIATE else "n:" + str(value.producer)
            style = ", style=dashed" if value.kind in (ValueKind.WEIGHT, ValueKind.STATE) else ""
            lines.append(f"  {_quote(src)} -> {_quote('n:' + node.name)} [label={_quote(value.spec.short())}{style}];")
    for name in flat.outputs:
        lines.append(f'  {_quote("out:" + name)} [label={_quote("return %" + name)}, shape=ellipse];')
        lines.append(f"  {_quote('n:' + str(flat.values[name].producer))} -> {_quote('out:' + name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
