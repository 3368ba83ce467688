"""validate(): reject malformed graphs with a message that names the node.

Errors show the offending line and a small window of its neighbours (its
producers and consumers), never the whole graph, as JAX's checker does.
"""

from __future__ import annotations

import torch
from draftgraph.runtime.errors import GraphError, describe
from draftgraph.runtime.ir.graph import Graph, Node, ValueKind
from draftgraph.runtime.ir.op_registry import ShapeRuleError, get_op, has_op
from draftgraph.runtime.ir.tensor_spec import TensorSpec

MAX_NEIGHBOURS = 3
GUARD_SPEC = TensorSpec((1,), torch.int32)  # a gate's flag: one int32 on the device


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
    """Raise GraphError for undefined, doubly defined or dangling values, bad shapes, cycles,
    or control flow the executors cannot run (a bad guard, a gated run split in the schedule,
    an in-place reuse the op does not declare)."""
    for name in graph.inputs:
        value = graph.values.get(name)
        if value is None or value.kind != ValueKind.INPUT:
            _fail(graph, None, f"graph input {name!r}: expected an input value, got {value and value.kind.value}")

    defined_by: dict[str, str] = {}
    for node in graph.nodes.values():
        for name in node.reads:
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

    order = schedule(graph)  # raises on cycles

    used = {name for node in graph.nodes.values() for name in node.reads}
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
        _check_control(graph, node)
    _check_guarded_runs(graph, order)


def _check_types(graph: Graph, node: Node) -> None:
    got = [graph.values[n].spec for n in node.outputs]
    have_in = [graph.values[n].spec for n in node.inputs]
    if node.subgraph is not None:
        _check_subgraph_call(graph, node)
        want = [node.subgraph.values[n].spec for n in node.subgraph.outputs]
        if want != got:
            _fail(graph, node, f"subgraph outputs: expected {_specs(want)}, got {_specs(got)}")
    if not has_op(node.op):
        if node.subgraph is None:
            _fail(graph, node, f"op {node.op!r} is not registered (hint: import the module that registers it)")
        return  # a plain call (``GraphBuilder.subgraph``): its subgraph is its type
    try:
        want = list(get_op(node.op).infer(have_in, node.attrs))
    except ShapeRuleError as exc:
        _fail(graph, node, str(exc))
    except GraphError as exc:
        _fail(graph, node, str(exc))
    if want != got:
        _fail(graph, node, f"output types: expected {_specs(want)}, got {_specs(got)}")


def _check_subgraph_call(graph: Graph, node: Node) -> None:
    """The node's first inputs are the subgraph's; any after them are state or weights it shares by name."""
    sub = node.subgraph
    validate(sub)
    n = len(sub.inputs)
    want_in = [sub.values[name].spec for name in sub.inputs]
    have_in = [graph.values[name].spec for name in node.inputs[:n]]
    if want_in != have_in:
        _fail(graph, node, f"subgraph inputs: expected {_specs(want_in)}, got {_specs(have_in)}")
    for name in node.inputs[n:]:
        value, inner = graph.values[name], sub.values.get(name)
        if not value.is_persistent or inner is None or inner.kind != value.kind or inner.spec != value.spec:
            _fail(graph, node, describe(f"input {value.ref} after the subgraph's {n}",
                                        "a weight or state the subgraph uses by the same name", value.ref,
                                        f"subgraph {sub.name!r} takes {n} inputs"))


def _check_control(graph: Graph, node: Node) -> None:
    if node.guard is not None:
        flag = graph.values[node.guard]
        if flag.spec != GUARD_SPEC:
            _fail(graph, node, describe(f"guard {flag.ref}", GUARD_SPEC.short(), flag.spec.short(),
                                        "a gate is one int32 flag on the device"))
        if flag.producer == node.name:
            _fail(graph, node, f"guard {flag.ref} is this node's own output (hint: a gate is set before it is read)")
    if node.may_reuse and (node.subgraph is not None or not has_op(node.op) or not get_op(node.op).inplace):
        _fail(graph, node, describe("may_reuse", f"an op that declares an in-place output, as {node.op!r} does not",
                                    "may_reuse=true", "only reuse_dying_inputs sets it"))


def _check_guarded_runs(graph: Graph, order: list[Node]) -> None:
    """Each guard's nodes are one unbroken run of the schedule: the executors run it as one block."""
    runs: list[str | None] = []
    for node in order:
        if not runs or runs[-1] != node.guard:
            runs.append(node.guard)
    flags = [flag for flag in runs if flag is not None]
    split = next((flag for flag in flags if flags.count(flag) > 1), None)
    if split is not None:
        first = next(node for node in order if node.guard == split)
        _fail(graph, first, describe(f"the nodes guarded by %{split}", "one unbroken run of the schedule",
                                     "a run split by other nodes", "keep a gated region's nodes together"))


def _specs(specs) -> str:
    return ", ".join(s.short() for s in specs)
