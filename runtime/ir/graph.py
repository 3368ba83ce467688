"""The graph IR: values, nodes and the graph that holds them.

A :class:`Graph` is a dataflow graph of op nodes stored on a ``networkx.DiGraph``
(node names as vertices, one edge per producer -> consumer value, plus ordering
edges for state). Values come in four kinds:

- ``input``: bound by the caller at run time (token, hidden, positions, ...);
- ``weight``: persistent, read-only, printed ``@name``;
- ``state``: persistent buffers an op mutates (the KV cache), printed ``$name``;
  every write orders the schedule against earlier reads and writes;
- ``intermediate``: produced by a node, placed in the arena.

A node may hold a ``subgraph`` as its implementation (the built-in ``body``, a target
layer): its first inputs and its outputs map positionally onto the subgraph's; weights and
state are shared by name. :func:`draftgraph.runtime.ir.schedule.flatten` inlines subgraphs.

Control flow is part of the IR, never read from a node's name:

- ``guard``: the name of an i32[1] value; the node runs only where it is nonzero (a
  confidence gate). Guarded nodes of one flag form one unbroken run of the schedule, which
  the eager executor runs after reading the flag and the captured one puts in a CUDA
  conditional node.
- ``may_reuse``: the node's outputs may take over the bytes of the inputs its op declares
  ``inplace`` (when such an input dies there). Declared graphs never set it; the
  ``reuse_dying_inputs`` pass does.

Build graphs with :class:`draftgraph.runtime.ir.builder.GraphBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import networkx as nx
from draftgraph.runtime.ir.tensor_spec import TensorSpec


class ValueKind(str, Enum):
    INPUT = "input"
    WEIGHT = "weight"
    STATE = "state"
    INTERMEDIATE = "intermediate"


SIGILS = {ValueKind.WEIGHT: "@", ValueKind.STATE: "$"}


@dataclass
class Value:
    name: str
    spec: TensorSpec
    kind: ValueKind
    producer: str | None = None  # node name, for intermediates

    @property
    def ref(self) -> str:
        """How the printer refers to the value: ``%x``, ``@weight`` or ``$state``."""
        return SIGILS.get(self.kind, "%") + self.name

    @property
    def is_persistent(self) -> bool:
        return self.kind in (ValueKind.WEIGHT, ValueKind.STATE)


@dataclass
class Node:
    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    subgraph: Graph | None = None
    scope: str = ""  # enclosing subgraph node after flattening, e.g. "d0.body"
    guard: str | None = None  # an i32[1] value: the node runs only where it is nonzero
    may_reuse: bool = False  # outputs may overwrite the inputs the op declares inplace

    @property
    def is_subgraph(self) -> bool:
        return self.subgraph is not None

    @property
    def reads(self) -> tuple[str, ...]:
        """Every value the node needs before it runs: its inputs and its guard."""
        return self.inputs if self.guard is None else (*self.inputs, self.guard)


class Graph:
    """A dataflow graph. Prefer :class:`GraphBuilder` to constructing one by hand."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.values: dict[str, Value] = {}
        self.nodes: dict[str, Node] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.discarded: set[str] = set()  # outputs deliberately left unused (printed like jaxpr's `_`)
        self.meta: dict[str, Any] = {}  # free-form facts for dumps (mode, num_drafts, ...)

    # ---- queries -------------------------------------------------------
    def value(self, name: str) -> Value:
        return self.values[name]

    def values_of_kind(self, kind: ValueKind) -> list[Value]:
        return [v for v in self.values.values() if v.kind == kind]

    @property
    def weights(self) -> list[Value]:
        return self.values_of_kind(ValueKind.WEIGHT)

    @property
    def state(self) -> list[Value]:
        return self.values_of_kind(ValueKind.STATE)

    @property
    def intermediates(self) -> list[Value]:
        return self.values_of_kind(ValueKind.INTERMEDIATE)

    def consumers(self) -> dict[str, list[str]]:
        """Value name -> names of the nodes that read it, in node order."""
        readers: dict[str, list[str]] = {name: [] for name in self.values}
        for node in self.nodes.values():
            for name in node.reads:
                if name in readers and node.name not in readers[name]:
                    readers[name].append(node.name)
        return readers

    def producer_of(self, value_name: str) -> Node | None:
        value = self.values.get(value_name)
        if value is None or value.producer is None:
            return None
        return self.nodes.get(value.producer)

    def has_subgraphs(self) -> bool:
        return any(n.is_subgraph for n in self.nodes.values())

    # ---- the networkx view -----------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """Nodes are node names; an edge per value (``value`` attr) and per state order."""
        from draftgraph.runtime.ir.schedule import state_order_edges

        g = nx.DiGraph()
        for index, node in enumerate(self.nodes.values()):
            g.add_node(node.name, op=node.op, index=index, scope=node.scope)
        for node in self.nodes.values():
            for name in node.reads:
                producer = self.producer_of(name)
                if producer is not None:
                    if g.has_edge(producer.name, node.name):
                        g.edges[producer.name, node.name]["values"].append(name)
                    else:
                        g.add_edge(producer.name, node.name, values=[name], kind="data")
        for before, after, state in state_order_edges(self):
            if not g.has_edge(before, after):
                g.add_edge(before, after, values=[state], kind="state")
        return g

    def copy(self) -> Graph:
        """An independent copy (subgraphs too): what a pass edits instead of its input."""
        from draftgraph.runtime.ir.serialize import from_json, to_json

        return from_json(to_json(self))

    # ---- equality and printing -------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        from draftgraph.runtime.ir.serialize import to_json

        return to_json(self) == to_json(other)

    def __repr__(self) -> str:
        from draftgraph.runtime.ir.printer import format_graph

        return format_graph(self)

    __hash__ = None  # mutable container
