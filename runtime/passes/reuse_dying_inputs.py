"""reuse_dying_inputs: let every op that declares an in-place output write over that input.

An op's ``inplace`` declaration says its implementation is correct whether or not the output
shares the input's bytes (hc_post's residual, a norm's input); this pass lets the planner take
that reuse (``Node.may_reuse``), which it does only where the input dies at that very node.
"""

from __future__ import annotations

from collections import Counter

from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.op_registry import get_op, has_op


def reuse_dying_inputs(graph: Graph) -> tuple[Graph, str]:
    graph = graph.copy()
    by_op: Counter[str] = Counter()
    _allow(graph, by_op)
    if not by_op:
        return graph, "no op declares an in-place output"
    ops = ", ".join(f"{op} {n}" for op, n in sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0])))
    return graph, f"{sum(by_op.values())} nodes may write over a dying input ({ops})"


def _allow(graph: Graph, by_op: Counter[str]) -> None:
    for node in graph.nodes.values():
        if node.subgraph is not None:
            _allow(node.subgraph, by_op)
        elif has_op(node.op) and get_op(node.op).inplace:
            node.may_reuse = True
            by_op[node.op] += 1
