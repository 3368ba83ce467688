"""Lossless JSON round trip of graphs, and Graphviz DOT."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from draftgraph.runtime.errors import GraphError
from draftgraph.runtime.ir.graph import Graph, Node, Value, ValueKind
from draftgraph.runtime.ir.tensor_spec import TensorSpec

if TYPE_CHECKING:
    from draftgraph.runtime.planning.graph_plan import GraphPlan

FORMAT_VERSION = 1


def to_json(graph: Graph) -> dict:
    return {
        "format": "draftgraph.graph",
        "version": FORMAT_VERSION,
        "name": graph.name,
        "meta": graph.meta,
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "discarded": sorted(graph.discarded),
        "values": [
            {"name": v.name, "kind": v.kind.value, **v.spec.to_json(), "producer": v.producer}
            for v in graph.values.values()
        ],
        "nodes": [
            {
                "name": n.name,
                "op": n.op,
                "inputs": list(n.inputs),
                "outputs": list(n.outputs),
                "attrs": n.attrs,
                "scope": n.scope,
                "subgraph": to_json(n.subgraph) if n.subgraph is not None else None,
            }
            for n in graph.nodes.values()
        ],
    }


def from_json(data: dict | str) -> Graph:
    if isinstance(data, str):
        data = json.loads(data)
    if data.get("format") != "draftgraph.graph":
        raise GraphError(f"graph JSON: expected format 'draftgraph.graph', got {data.get('format')!r}")
    graph = Graph(data["name"])
    graph.meta = dict(data.get("meta", {}))
    graph.inputs = list(data["inputs"])
    graph.outputs = list(data["outputs"])
    graph.discarded = set(data.get("discarded", []))
    for v in data["values"]:
        spec = TensorSpec.from_json(v)
        graph.values[v["name"]] = Value(v["name"], spec, ValueKind(v["kind"]), v.get("producer"))
    for n in data["nodes"]:
        sub = from_json(n["subgraph"]) if n.get("subgraph") else None
        graph.nodes[n["name"]] = Node(
            n["name"], n["op"], tuple(n["inputs"]), tuple(n["outputs"]), dict(n["attrs"]), sub, n.get("scope", "")
        )
    return graph


def dumps(graph: Graph) -> str:
    return json.dumps(to_json(graph), indent=1)


# ---- DOT -----------------------------------------------------------------------


def _quote(text: str) -> str:
    """A DOT string. Labels carry DOT's own ``\\n`` line breaks, so only quotes are escaped."""
    return '"' + text.replace('"', '\\"') + '"'


def to_dot(graph: Graph, plan: GraphPlan | None = None, colors: dict[str, str] | None = None) -> str:
    """Graphviz DOT: op nodes as boxes, weights and state apart, edges labelled dtype[shape].

    Nodes of one scope (e.g. ``d0.body``) are drawn as a labelled cluster.
    """
    from draftgraph.runtime.ir.schedule import flatten

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
            from draftgraph.runtime.ir.op_registry import get_op

            family = "runner" if node.op == "body_runner" else get_op(node.op).family
            color = colors.get(family, "#dddddd")
            label = node.name.rsplit(".", 1)[-1] + "\\n" + node.op
            if plan is not None and node.outputs and node.outputs[0] in plan.offsets:
                label += f"\\n+{plan.offsets[node.outputs[0]]:#x}"
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
