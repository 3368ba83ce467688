"""view_single_stacks: a ``stack`` of one value becomes a ``reshape`` to [..., 1], a view.

A K=1 chain stacks one draft and one probability; a stack of one is a copy kernel each, a
reshape is no kernel at all (its output is a view of its input's bytes).
"""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph


def view_single_stacks(graph: Graph) -> tuple[Graph, str]:
    graph = graph.copy()
    viewed = 0
    for node in graph.nodes.values():
        if node.op == "stack" and len(node.inputs) == 1:
            node.op = "reshape"
            node.attrs = {"shape": [*graph.values[node.inputs[0]].spec.shape, 1]}
            viewed += 1
    if not viewed:
        return graph, "no stack of one value"
    return graph, f"{viewed} stack{'s' if viewed != 1 else ''} of one value made {'a view' if viewed == 1 else 'views'}"
