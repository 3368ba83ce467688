"""inline_subgraphs: replace every node that carries a subgraph (the built-in body, a target
layer) by the subgraph's nodes, scoped under the node's name (``d0.body.attn``)."""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.schedule import flatten


def inline_subgraphs(graph: Graph) -> tuple[Graph, str]:
    calls = [n for n in graph.nodes.values() if n.subgraph is not None]
    if not calls:
        return graph.copy(), "no subgraph to inline"
    flat = flatten(graph)
    added = len(flat.nodes) - (len(graph.nodes) - len(calls))
    return flat, f"{len(calls)} subgraph{_s(calls)} inlined ({added} nodes)"


def _s(items) -> str:
    return "" if len(items) == 1 else "s"
