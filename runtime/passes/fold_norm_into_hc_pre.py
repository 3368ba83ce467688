"""fold_norm_into_hc_pre: ``rms_norm(hc_pre(X).y, w)`` -> ``hc_pre_norm(X, ..., w)``, one node.

Each half of the V4 block starts with hc_pre, whose y only the half's norm reads (spec section
2: attn_norm, ffn_norm). Apart, the fused path runs hc_pre's finish launch, then a norm launch
that reads y back. Folded, the finish program of a row, which holds its whole y, writes it
normed (ops/triton/mhc.py, note "norm in the finish"): one launch fewer a half, and the torch
path runs the same two ops as before, in the same order (ops/mhc.py, ``hc_pre_norm``).
"""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph


def fold_norm_into_hc_pre(graph: Graph) -> tuple[Graph, str]:
    graph = graph.copy()
    readers = graph.consumers()
    folded = 0
    for node in list(graph.nodes.values()):
        if node.op != "hc_pre":
            continue
        y = node.outputs[0]
        norm = graph.nodes[readers[y][0]] if len(readers[y]) == 1 else None
        if (norm is None or norm.op != "rms_norm" or norm.inputs[0] != y or y in graph.outputs
                or norm.guard != node.guard):  # fmt: skip
            continue
        normed = norm.outputs[0]
        node.op = "hc_pre_norm"
        node.inputs = (*node.inputs, norm.inputs[1])
        node.attrs = {**node.attrs, "norm_eps": norm.attrs["eps"]}
        node.outputs = (normed, *node.outputs[1:])
        graph.values[normed].producer = node.name
        del graph.nodes[norm.name]
        del graph.values[y]
        folded += 1
    if not folded:
        return graph, "no rms_norm reads an hc_pre's y"
    return graph, f"{folded} rms_norm folded into the hc_pre before {'it' if folded == 1 else 'each'}"
