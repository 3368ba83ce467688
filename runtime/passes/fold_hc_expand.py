"""fold_hc_expand: ``combiner(hc_expand(e), H)`` -> ``combiner(e, H)``, the embedding half once.

In streams mode the declared step expands the embedding to the C streams before the combiner
(spec section 5: ``e_proj(e)`` is added to every stream). The combiner computes its embedding
half per row, so on C identical copies it does the same norm and projection C times. Folded,
it computes that half once on the [B, D] embedding and broadcasts it in the sum: the same
values, no [B, C, D] copy, and C times fewer embedding-half rows.
"""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph, Node
from draftgraph.runtime.passes.sole_producer import fold_into_readers


def _read_the_embedding_once(combiner: Node, expand: Node) -> None:
    combiner.inputs = (expand.inputs[0], *combiner.inputs[1:])


def fold_hc_expand(graph: Graph) -> tuple[Graph, str]:
    graph, folded = fold_into_readers(graph, "combiner", "hc_expand", _read_the_embedding_once)
    if not folded:
        return graph, "no hc_expand feeds a combiner"
    return graph, f"{folded} hc_expand folded into the combiner's broadcast"
