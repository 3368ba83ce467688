"""sole_producer: the node a fold may merge into its one reader.

A fold that moves a producer's work into the node reading its output (fold_hc_expand,
fold_embed_into_combiner) may do so only where nothing else sees that output: the reader is its
only reader, the graph does not return it, and both nodes run under the same guard (a guarded
node's work must not move out of, or into, its branch). ``fold_into_readers`` is such a fold's
loop; each pass gives it the rewrite of the reader.
"""

from __future__ import annotations

from collections.abc import Callable

from draftgraph.runtime.ir.graph import Graph, Node


def sole_producer(graph: Graph, readers: dict[str, list[str]], node: Node, value: str, op: str) -> Node | None:
    """The ``op`` node making ``value`` when ``node`` alone reads it (``readers``: graph.consumers()), else None."""
    producer = graph.producer_of(value)
    if (producer is None or producer.op != op or readers[value] != [node.name] or value in graph.outputs
            or producer.guard != node.guard):  # fmt: skip
        return None
    return producer


def fold_into_readers(graph: Graph, reader_op: str, producer_op: str,
                      merge: Callable[[Node, Node], None]) -> tuple[Graph, int]:
    """(a copy of ``graph``, how many folded): each ``producer_op`` node whose output a ``reader_op`` node
    alone reads, as its first input, removed with that output after ``merge(reader, producer)`` has
    rewritten the reader to do the producer's work."""
    graph = graph.copy()
    readers = graph.consumers()
    folded = 0
    for node in list(graph.nodes.values()):
        if node.op != reader_op:
            continue
        value = node.inputs[0]
        producer = sole_producer(graph, readers, node, value, producer_op)
        if producer is None:
            continue
        merge(node, producer)
        del graph.nodes[producer.name]
        del graph.values[value]
        folded += 1
    return graph, folded
