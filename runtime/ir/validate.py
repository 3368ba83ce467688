"""validate(): reject malformed graphs with a message that names the node.

Errors show the offending line and a small window of its neighbours (its
producers and consumers), never the whole graph, as JAX's checker does.
"""

from __future__ import annotations

from draftgraph.runtime.errors import GraphError
from draftgraph.runtime.ir.graph import Graph, Node, ValueKind
from draftgraph.runtime.ir.op_registry import ShapeRuleError, get_op

MAX_NEIGHBOURS = 3


def neighbourhood(graph: Graph, node: Node) -> str:
    """The node's printed line with up to three producers above and consumers below."""
    from draftgraph.runtime.ir.printer import format_node

    producers = []
    for name in node.inputs:
        producer = graph.producer_of(name)
        if producer is not None and producer not in producers:
            producers.append(producer)
    consumers = [
        other
        for other in graph.nodes.values()
        if other is not node and any(o in other.inputs for o in node.outputs)
    ]
    lines = [f"    {format_node(graph, p)}" for p in producers[:MAX_NEIGHBOURS]]
    if len(producers) > MAX_NEIGHBOURS:
        lines.append("    ...")
    lines.append(f"--> {format_node(graph, node)}")
    lines += [f"    {format_node(graph, c)}" for c in consumers[:MAX_NEIGHBOURS]]
    if len(consumers) > MAX_NEIGHBOURS:
        lines.append("    ...")
    return "\n".join(lines)


def _fail(graph: Graph, node: Node | None, message: str) -> None:
    where = f"%{node.name}: " if node is not None else ""
    text = f"graph {graph.name!r}: {where}{message}"
    if node is not None:
        try:
            text += "\n" + neighbourhood(graph, node)
        except Exception:  # the window is a courtesy; never mask the real error
            pass
    raise GraphError(text)


def validate(graph: Graph) -> None:
    """Raise GraphError for undefined, doubly defined or dangling values, bad shapes, or cycles."""
    for name in graph.inputs:
        value = graph.values.get(name)
        if value is None or value.kind != ValueKind.INPUT:
            _fail(graph, None, f"graph input {name!r}: expected an input value, got {value and value.kind.value}")

    defined_by: dict[str, str] = {}
    for node in graph.nodes.values():
        for name in node.inputs:
            if name not in graph.values:
                _fail(graph, node, f"input %{name} is undefined (hint: define it before its first use)")
        for name in node.outputs:
            value = graph.values.get(name)
            if value is None:
                _fail(graph, node, f"output %{name} has no value record")
            if value.kind != ValueKind.INTERMEDIATE:
                _fail(graph, node, f"output {value.ref} is a {value.kind.value} and cannot be defined by a node")
            if name in defined_by:
                _fail(graph, node, f"%{name} is defined twice (first by %{defined_by[name]})")
            if value.producer != node.name:
                _fail(graph, node, f"%{name} records producer {value.producer!r}, not this node")
            defined_by[name] = node.name
    for value in graph.intermediates:
        if value.name not in defined_by:
            _fail(graph, None, f"intermediate %{value.name} is never defined")

    from draftgraph.runtime.ir.schedule import schedule

    schedule(graph)  # raises on cycles

    used = {name for node in graph.nodes.values() for name in node.inputs}
    for name in graph.outputs:
        if name not in graph.values:
            _fail(graph, None, f"graph output %{name} is undefined")
    for node in graph.nodes.values():
        dangling = [
            o for o in node.outputs if o not in used and o not in graph.outputs and o not in graph.discarded
        ]
        if dangling:
            names = ", ".join(f"%{o}" for o in dangling)
            _fail(graph, node, f"dangling output {names}: never used (hint: use it, return it, or discard it)")
        _check_types(graph, node)


def _check_types(graph: Graph, node: Node) -> None:
    got = [graph.values[n].spec for n in node.outputs]
    if node.subgraph is not None:
        validate(node.subgraph)
        want_in = [node.subgraph.values[n].spec for n in node.subgraph.inputs]
        have_in = [graph.values[n].spec for n in node.inputs]
        if want_in != have_in:
            _fail(graph, node, f"subgraph inputs: expected {_specs(want_in)}, got {_specs(have_in)}")
        want = [node.subgraph.values[n].spec for n in node.subgraph.outputs]
    elif node.op == "body_runner":
        return  # a runner declares its own interface; checked when it is bound
    else:
        try:
            want = list(get_op(node.op).infer([graph.values[n].spec for n in node.inputs], node.attrs))
        except ShapeRuleError as exc:
            _fail(graph, node, str(exc))
        except GraphError as exc:
            _fail(graph, node, str(exc))
    if want != got:
        _fail(graph, node, f"output types: expected {_specs(want)}, got {_specs(got)}")


def _specs(specs) -> str:
    return ", ".join(s.short() for s in specs)
