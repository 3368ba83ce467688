"""sole_producer: the node a fold may merge into its one reader.

A fold that moves a producer's work into the node reading its output (fold_hc_expand,
fold_embed_into_combiner) may do so only where nothing else sees that output: the reader is its
only reader, the graph does not return it, and both nodes run under the same guard (a guarded
node's work must not move out of, or into, its branch).
"""

from __future__ import annotations

from draftgraph.runtime.ir.graph import Graph, Node


def sole_producer(graph: Graph, readers: dict[str, list[str]], node: Node, value: str, op: str) -> Node | None:
    """The ``op`` node making ``value`` when ``node`` alone reads it (``readers``: graph.consumers()), else None."""
    producer = graph.producer_of(value)
    if (producer is None or producer.op != op or readers[value] != [node.name] or value in graph.outputs
            or producer.guard != node.guard):  # fmt: skip
        return None
    return producer
