"""The one printer: repr, errors, dumps and golden tests all use it.

One line per node, jaxpr/fx style::

    %d0.hc_post: bf16[B,4,256] = hc_post(%d0.attn, %d0.x, %d0.pre.post, %d0.pre.comb)  # +0x1200 2K  free %d0.x

weights print as ``@name``, state as ``$name``, attrs sorted in ``[k=v]``; a node with a
subgraph prints as ``op<subgraph name>`` with the subgraph's lines indented below it. Control
flow follows the call: ``when %flag`` (a guard: the node runs only where the flag is nonzero)
and ``may reuse %x`` (its output may take over the bytes of ``%x`` where ``%x`` dies).
Given a plan (any :class:`PlanNotes`: ``planning.graph_plan.GraphPlan`` is one), the
lines follow its order, each ends with the plan's comment (arena offsets and bytes, the
values whose bytes die there), and its summary closes the listing.
"""

from __future__ import annotations

from typing import Protocol

from draftgraph.runtime.ir.graph import Graph, Node
from draftgraph.runtime.ir.op_registry import get_op, has_op


class PlanNotes(Protocol):
    """What the printer reads of a plan: its node order, a comment per node, a summary line."""

    order: list[str]

    def comment(self, graph: Graph, node: Node) -> str: ...

    def summary_line(self) -> str: ...


def format_attr(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "(" + ",".join(format_attr(v) for v in value) + ")"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_attrs(attrs: dict) -> str:
    if not attrs:
        return ""
    return "[" + ", ".join(f"{k}={format_attr(v)}" for k, v in sorted(attrs.items())) + "]"


def format_node(graph: Graph, node: Node, plan: PlanNotes | None = None) -> str:
    outs = []
    for name in node.outputs:
        shown = "_" if name in graph.discarded else f"%{name}"
        outs.append(f"{shown}: {graph.values[name].spec.short()}")
    args = ", ".join(_ref(graph, n) for n in node.inputs)
    op = node.op if node.subgraph is None else f"{node.op}<{node.subgraph.name}>"
    line = f"{', '.join(outs)} = {op}{format_attrs(node.attrs)}({args})"
    if node.guard is not None:
        line += f" when {_ref(graph, node.guard)}"
    if node.may_reuse and has_op(node.op):
        reused = sorted({node.inputs[i] for i in get_op(node.op).inplace.values() if i < len(node.inputs)})
        line += " may reuse " + ", ".join(_ref(graph, n) for n in reused)
    if plan is not None:
        line += plan.comment(graph, node)
    return line


def _ref(graph: Graph, name: str) -> str:
    return graph.values[name].ref if name in graph.values else f"%{name}?"


def format_graph(graph: Graph, plan: PlanNotes | None = None, show_weights: bool = True) -> str:
    """The whole graph, one node a line; with a plan, arena comments and a summary line."""
    from draftgraph.runtime.ir.schedule import schedule

    try:
        order = schedule(graph) if plan is None else [graph.nodes[n] for n in plan.order]
    except Exception:  # a graph with a cycle still prints, in builder order
        order = list(graph.nodes.values())
    params = ", ".join(f"%{n}: {graph.values[n].spec.short()}" for n in graph.inputs)
    lines = [f"graph {graph.name}({params}) {{"]
    if show_weights:
        for value in graph.weights + graph.state:
            lines.append(f"  {value.ref}: {value.spec.short()}")
    for node in order:
        lines.append(f"  {format_node(graph, node, plan)}")
        if node.subgraph is not None:
            inner = format_graph(node.subgraph, show_weights=False).splitlines()
            lines += [f"    {text}" for text in inner]
    lines.append(f"  return ({', '.join('%' + n for n in graph.outputs)})")
    lines.append("}")
    if plan is not None:
        lines.append(plan.summary_line())
    return "\n".join(lines)
