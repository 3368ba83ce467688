"""GraphBuilder: declare a graph op by op, with shape inference as you go.

Example
-------
>>> import torch
>>> from draftgraph.runtime.ir.builder import GraphBuilder
>>> from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
>>> b = GraphBuilder("demo")
>>> x = b.input("x", TensorSpec((B, 8), torch.float32))
>>> w = b.weight("w", TensorSpec((4, 8), torch.float32))
>>> y = b.op("linear", [x, w], name="proj")
>>> b.output(y)
>>> graph = b.build()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from draftgraph.runtime.errors import GraphError, describe
from draftgraph.runtime.ir.graph import Graph, Node, Value, ValueKind
from draftgraph.runtime.ir.op_registry import ShapeRuleError, get_op
from draftgraph.runtime.ir.tensor_spec import TensorSpec


def normalize_attrs(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Tuples become lists so that a JSON round trip is lossless."""

    def norm(v):
        if isinstance(v, (tuple, list)):
            return [norm(x) for x in v]
        return v

    return {k: norm(v) for k, v in sorted((attrs or {}).items())}


def _name(what: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise GraphError(describe(what, "a non-empty str", repr(name)))
    return name


def _values(what: str, values: object) -> tuple[Value, ...]:
    """``values`` as a tuple of Values (the builder's own results); anything else is a GraphError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, set, frozenset)):
        raise GraphError(describe(what, "a sequence of values the builder made", type(values).__name__))
    bad = [type(v).__name__ for v in values if not isinstance(v, Value)]
    if bad:
        raise GraphError(describe(what, "values the builder made (b.input, b.weight, b.op ...)", bad,
                                  "pass what those calls returned"))
    return tuple(values)


class GraphBuilder:
    def __init__(self, name: str = "graph") -> None:
        self.graph = Graph(_name("graph name", name))
        self._prefix: list[str] = []
        self._guard: str | None = None

    # ---- naming ----------------------------------------------------------
    def scoped(self, prefix: str) -> _Scope:
        """``with b.scoped("d0"):`` prefixes node and value names with ``d0.``."""
        return _Scope(self, prefix)

    def guarded(self, flag: Value) -> _Guard:
        """``with b.guarded(flag):`` the nodes added inside run only where ``flag`` (i32[1]) is nonzero."""
        return _Guard(self, flag)

    def _qualify(self, name: str) -> str:
        return ".".join([*self._prefix, name])

    def _unique(self, name: str) -> str:
        if name not in self.graph.values and name not in self.graph.nodes:
            return name
        i = 1
        while f"{name}_{i}" in self.graph.values or f"{name}_{i}" in self.graph.nodes:
            i += 1
        return f"{name}_{i}"

    # ---- values ------------------------------------------------------------
    def _add_value(self, name: str, spec: TensorSpec, kind: ValueKind, producer=None) -> Value:
        _name(f"{kind.value} name", name)
        if not isinstance(spec, TensorSpec):
            raise GraphError(describe(f"{kind.value} {name!r} spec", "a TensorSpec", type(spec).__name__))
        if name in self.graph.values:
            raise GraphError(f"value {name!r} is defined twice (hint: names must be unique)")
        value = Value(name, spec, kind, producer)
        self.graph.values[name] = value
        return value

    def input(self, name: str, spec: TensorSpec) -> Value:
        value = self._add_value(name, spec, ValueKind.INPUT)
        self.graph.inputs.append(name)
        return value

    def weight(self, name: str, spec: TensorSpec) -> Value:
        """A persistent read-only tensor, shared by name (declaring it again is a no-op)."""
        return self._persistent(name, spec, ValueKind.WEIGHT)

    def state(self, name: str, spec: TensorSpec) -> Value:
        """A persistent buffer that ops mutate (the KV cache), shared by name."""
        return self._persistent(name, spec, ValueKind.STATE)

    def _persistent(self, name: str, spec: TensorSpec, kind: ValueKind) -> Value:
        existing = self.graph.values.get(name)
        if existing is not None:
            if existing.kind != kind or existing.spec != spec:
                raise GraphError(
                    f"{kind.value} {name!r}: expected {existing.kind.value} {existing.spec}, got "
                    f"{kind.value} {spec} (hint: one name, one tensor)"
                )
            return existing
        return self._add_value(name, spec, kind)

    # ---- nodes -------------------------------------------------------------
    def op(
        self,
        op_name: str,
        inputs: Sequence[Value],
        name: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        subgraph: Graph | None = None,
    ) -> Value | tuple[Value, ...]:
        """Add a node; returns its output value (or a tuple for multi-output ops).

        ``subgraph``: the node's implementation as a graph (inlined by ``flatten``); its inputs
        are the node's first inputs, in order, and its outputs the node's.
        """
        opdef = get_op(_name("op name", op_name))
        inputs = _values(f"{op_name} inputs", inputs)
        if name is not None:
            _name(f"{op_name} node name", name)
        attrs = normalize_attrs(attrs)
        node_name = self._unique(self._qualify(name or op_name))
        try:
            specs = list(opdef.infer([v.spec for v in inputs], attrs))
        except ShapeRuleError as exc:
            args = ", ".join(v.ref for v in inputs)
            raise GraphError(f"%{node_name} = {op_name}({args}): {exc}") from None
        if len(opdef.output_names) == 1:
            out_names = [node_name]
        else:
            out_names = [f"{node_name}.{o}" for o in opdef.output_names]
        if subgraph is not None:
            self._share_persistent(subgraph)
        return self._add_node(node_name, op_name, inputs, out_names, specs, attrs, subgraph)

    def subgraph(
        self, name: str, graph: Graph, inputs: Sequence[Value], attrs: Mapping[str, Any] | None = None
    ) -> Value | tuple[Value, ...]:
        """Call ``graph`` as one node. Its weights and state join this graph by name."""
        _name("subgraph name", name)
        if not isinstance(graph, Graph):
            raise GraphError(describe(f"subgraph {name!r}", "a Graph (GraphBuilder.build())", type(graph).__name__))
        inputs = _values(f"subgraph {name!r} inputs", inputs)
        if len(inputs) != len(graph.inputs):
            raise GraphError(
                f"subgraph {name!r} inputs: expected {len(graph.inputs)} ({', '.join(graph.inputs)}), "
                f"got {len(inputs)}"
            )
        for given, formal in zip(inputs, graph.inputs):
            want = graph.values[formal].spec
            if given.spec != want:
                raise GraphError(f"subgraph {name!r} input {formal}: expected {want}, got {given.spec}")
        self._share_persistent(graph)
        node_name = self._unique(self._qualify(name))
        specs = [graph.values[o].spec for o in graph.outputs]
        if len(specs) == 1:
            out_names = [node_name]
        else:
            out_names = [f"{node_name}.{o.rsplit('.', 1)[-1]}" for o in graph.outputs]
        return self._add_node(node_name, "subgraph", inputs, out_names, specs, normalize_attrs(attrs), graph)

    def _share_persistent(self, graph: Graph) -> None:
        for value in graph.values.values():
            if value.is_persistent:
                self._persistent(value.name, value.spec, value.kind)

    def _add_node(self, node_name, op_name, inputs, out_names, specs, attrs, subgraph):
        for v in inputs:
            if self.graph.values.get(v.name) is not v:
                raise GraphError(f"%{node_name}: input {v.ref} is not a value of graph {self.graph.name!r}")
        outs = [self._add_value(n, s, ValueKind.INTERMEDIATE, node_name) for n, s in zip(out_names, specs)]
        node = Node(node_name, op_name, tuple(v.name for v in inputs), tuple(out_names), attrs, subgraph,
                    guard=self._guard)
        self.graph.nodes[node_name] = node
        return outs[0] if len(outs) == 1 else tuple(outs)

    # ---- outputs -------------------------------------------------------------
    def output(self, *values: Value) -> None:
        for v in _values("outputs", values):
            if v.name in self.graph.outputs:
                raise GraphError(f"output {v.ref} is declared twice")
            self.graph.outputs.append(v.name)

    def discard(self, *values: Value) -> None:
        """Mark outputs of a multi-output op as deliberately unused."""
        self.graph.discarded.update(v.name for v in _values("discarded", values))

    def build(self, validate: bool = True) -> Graph:
        if validate:
            from draftgraph.runtime.ir.validate import validate as run_validate

            run_validate(self.graph)
        return self.graph


class _Guard:
    def __init__(self, builder: GraphBuilder, flag: Value) -> None:
        if builder._guard is not None:
            raise GraphError(f"guard {flag.ref}: expected no enclosing guard, got %{builder._guard} "
                             "(hint: a node has one gate)")
        self.builder, self.flag = builder, flag

    def __enter__(self) -> GraphBuilder:
        self.builder._guard = self.flag.name
        return self.builder

    def __exit__(self, *exc) -> None:
        self.builder._guard = None


class _Scope:
    def __init__(self, builder: GraphBuilder, prefix: str) -> None:
        self.builder, self.prefix = builder, prefix

    def __enter__(self) -> GraphBuilder:
        self.builder._prefix.append(self.prefix)
        return self.builder

    def __exit__(self, *exc) -> None:
        self.builder._prefix.pop()
