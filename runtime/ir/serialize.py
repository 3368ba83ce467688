"""Lossless JSON round trip of graphs."""

from __future__ import annotations

import json

from draftgraph.runtime.errors import GraphError
from draftgraph.runtime.ir.graph import Graph, Node, Value, ValueKind
from draftgraph.runtime.ir.tensor_spec import TensorSpec

FORMAT_VERSION = 2  # 2: nodes carry guard and may_reuse (control flow in the IR)


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
                "guard": n.guard,
                "may_reuse": n.may_reuse,
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
            n["name"], n["op"], tuple(n["inputs"]), tuple(n["outputs"]), dict(n["attrs"]), sub, n.get("scope", ""),
            n.get("guard"), bool(n.get("may_reuse", False)),
        )
    return graph


def dumps(graph: Graph) -> str:
    return json.dumps(to_json(graph), indent=1)
