"""fold_hc_expand: ``combiner(hc_expand(e), H)`` -> ``combiner(e, H)``, the embedding half once.

In streams mode the declared step expands the embedding to the C streams before the combiner
(spec section 5: ``e_proj(e)`` is added to every stream). The combiner computes its embedding
half per row, so on C identical copies it does the same norm and projection C times. Folded,
it computes that half once on the [B, D] embedding and broadcasts it in the sum: the same
values, no [B, C, D] copy, and C times fewer embedding-half rows.
"""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.passes.sole_producer import sole_producer


def fold_hc_expand(graph: Graph) -> tuple[Graph, str]:
    graph = graph.copy()
    readers = graph.consumers()
    folded = 0
    for node in list(graph.nodes.values()):
        if node.op != "combiner":
            continue
        expanded = node.inputs[0]
        expand = sole_producer(graph, readers, node, expanded, "hc_expand")
        if expand is None:
            continue
        node.inputs = (expand.inputs[0], *node.inputs[1:])
        del graph.nodes[expand.name]
        del graph.values[expanded]
        folded += 1
    if not folded:
        return graph, "no hc_expand feeds a combiner"
    return graph, f"{folded} hc_expand folded into the combiner's broadcast"
