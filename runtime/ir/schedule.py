"""Scheduling: state ordering, a deterministic topological order, and flattening.

The schedule is the builder's order wherever data and state dependencies allow
it (a lexicographic topological sort keyed by insertion index), so dumps and
arena plans are stable from run to run.
"""

from __future__ import annotations

import networkx as nx
from draftgraph.runtime.errors import GraphError, describe
from draftgraph.runtime.ir.graph import Graph, Node, Value, ValueKind
from draftgraph.runtime.ir.op_registry import get_op, has_op


def written_state(graph: Graph, node: Node) -> set[str]:
    """Names of the state values ``node`` mutates: its op's declared ones, and its subgraph's."""
    if node.subgraph is not None:
        written = {s for inner in node.subgraph.nodes.values() for s in written_state(node.subgraph, inner)}
        if not has_op(node.op):  # a plain call: its subgraph says it all
            return written
    else:
        written = set()
    return written | {node.inputs[i] for i in get_op(node.op).mutates if i < len(node.inputs)}


def touched_state(graph: Graph, node: Node) -> set[str]:
    """State values a node reads or writes (a subgraph's state is reached by name)."""
    names = {n for n in node.inputs if n in graph.values and graph.values[n].kind == ValueKind.STATE}
    if node.subgraph is not None:
        for inner in node.subgraph.nodes.values():
            names |= touched_state(node.subgraph, inner)
    return names | written_state(graph, node)


def state_order_edges(graph: Graph) -> list[tuple[str, str, str]]:
    """(before, after, state) edges: a write follows earlier reads and writes; a read follows writes."""
    edges: list[tuple[str, str, str]] = []
    last_writer: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    for node in graph.nodes.values():
        writes = written_state(graph, node)
        for state in sorted(touched_state(graph, node)):
            if state in writes:
                for before in [last_writer.get(state), *readers.get(state, [])]:
                    if before is not None and before != node.name:
                        edges.append((before, node.name, state))
                last_writer[state] = node.name
                readers[state] = []
            else:
                if state in last_writer:
                    edges.append((last_writer[state], node.name, state))
                readers.setdefault(state, []).append(node.name)
    return edges


def schedule(graph: Graph) -> list[Node]:
    """Deterministic topological order of ``graph``'s nodes (builder order when legal)."""
    g = graph.to_networkx()
    index = {name: i for i, name in enumerate(graph.nodes)}
    try:
        order = list(nx.lexicographical_topological_sort(g, key=lambda n: index[n]))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(g)
        path = " -> ".join(f"%{a}" for a, _ in cycle) + f" -> %{cycle[0][0]}"
        raise GraphError(f"graph {graph.name!r} has a cycle: {path}") from None
    return [graph.nodes[name] for name in order]


def flatten(graph: Graph) -> Graph:
    """Inline every subgraph node; inner names get the node's name as prefix and scope.

    Inner nodes take the call's guard: a gated body runs, node by node, under its gate.
    """
    if not graph.has_subgraphs():
        return graph
    flat = Graph(graph.name)
    flat.meta = dict(graph.meta)
    flat.inputs = list(graph.inputs)
    flat.outputs = list(graph.outputs)
    flat.discarded = set(graph.discarded)
    for value in graph.values.values():
        if value.kind != ValueKind.INTERMEDIATE:
            flat.values[value.name] = Value(value.name, value.spec, value.kind)
    for node in graph.nodes.values():
        if node.subgraph is None:
            _copy_node(flat, graph, node, node.name, {}, node.scope, node.guard)
        else:
            _inline(flat, graph, node)
    return flat


def _copy_node(flat: Graph, src: Graph, node: Node, new_name: str, rename: dict[str, str], scope: str,
               guard: str | None) -> None:
    inputs = tuple(rename.get(n, n) for n in node.inputs)
    outputs = tuple(rename.get(n, n) for n in node.outputs)
    for old, new in zip(node.outputs, outputs):
        flat.values[new] = Value(new, src.values[old].spec, ValueKind.INTERMEDIATE, new_name)
    flat.nodes[new_name] = Node(new_name, node.op, inputs, outputs, dict(node.attrs), None, scope, guard,
                                node.may_reuse)


def _inline(flat: Graph, parent: Graph, call: Node) -> None:
    inner = flatten(call.subgraph)
    rename: dict[str, str] = dict(zip(inner.inputs, call.inputs))
    for formal, actual in zip(inner.outputs, call.outputs):
        if formal in inner.inputs:
            raise GraphError(
                f"subgraph %{call.name}: output {formal!r} is one of its inputs "
                "(hint: a pass-through body is a runner, not a subgraph)"
            )
        rename[formal] = actual
    for node in inner.nodes.values():
        if node.guard is not None and call.guard is not None:
            raise GraphError(describe(f"%{call.name}.{node.name} guard", f"the call's gate %{call.guard} alone",
                                      f"a gate inside a gated subgraph, %{node.guard}", "a node has one gate"))
    for value in inner.values.values():
        if value.is_persistent:
            flat.values.setdefault(value.name, Value(value.name, value.spec, value.kind))
        elif value.kind == ValueKind.INTERMEDIATE and value.name not in rename:
            rename[value.name] = f"{call.name}.{value.name}"
    for node in inner.nodes.values():
        scope = call.name if not node.scope else f"{call.name}.{node.scope}"
        guard = call.guard or (rename.get(node.guard, node.guard) if node.guard else None)
        _copy_node(flat, inner, node, f"{call.name}.{node.name}", rename, scope, guard)
    flat.discarded.update(rename.get(n, n) for n in inner.discarded)
