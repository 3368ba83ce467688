"""fold_embed_into_combiner: ``combiner(embed(token, table), H, ...)`` -> ``embed_combiner(token, table, H, ...)``.

Each draft step starts with the embedding gather, whose [B, D] rows only the combiner's enorm
reads (spec section 5; in streams mode after fold_hc_expand has removed the expand between
them). Apart, the gather is a launch of its own (torch's index_select: no programmatic
dependent launch, so the combiner's first kernel cannot start under it) and a row block written
to be read back. Folded, the combiner's norm reads each row from the table at its token's index
(ops/triton/combiner.py, note "rows from the table"): one launch fewer a step, the same values,
and the torch path runs the two ops as before (ops/combiner.py, ``embed_combiner``).
"""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.passes.sole_producer import sole_producer


def fold_embed_into_combiner(graph: Graph) -> tuple[Graph, str]:
    graph = graph.copy()
    readers = graph.consumers()
    folded = 0
    for node in list(graph.nodes.values()):
        if node.op != "combiner":
            continue
        rows = node.inputs[0]
        embed = sole_producer(graph, readers, node, rows, "embed")
        if embed is None:
            continue
        node.op = "embed_combiner"
        node.inputs = (*embed.inputs, *node.inputs[1:])
        del graph.nodes[embed.name]
        del graph.values[rows]
        folded += 1
    if not folded:
        return graph, "no embed feeds only a combiner"
    return graph, f"{folded} embed folded into the combiner after {'it' if folded == 1 else 'each'}"
