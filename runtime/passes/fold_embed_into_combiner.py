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

from draftgraph.runtime.ir.graph import Graph, Node
from draftgraph.runtime.passes.sole_producer import fold_into_readers


def _read_rows_from_the_table(combiner: Node, embed: Node) -> None:
    combiner.op = "embed_combiner"
    combiner.inputs = (*embed.inputs, *combiner.inputs[1:])


def fold_embed_into_combiner(graph: Graph) -> tuple[Graph, str]:
    graph, folded = fold_into_readers(graph, "combiner", "embed", _read_rows_from_the_table)
    if not folded:
        return graph, "no embed feeds only a combiner"
    return graph, f"{folded} embed folded into the combiner after {'it' if folded == 1 else 'each'}"
