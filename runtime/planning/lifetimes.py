"""Lifetimes of intermediates from a schedule, and the alias groups ops declare.

Pure functions of (graph, schedule): no device state. A value is live from the
step that defines it through its last use; a graph output lives to the end.
Values share bytes only where an op declared it: a ``view`` output always
shares its base; an ``inplace`` output of a node allowed to reuse (``may_reuse``, set by
the ``reuse_dying_inputs`` pass) shares its input when that input's group dies at that
very step.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftgraph.runtime.ir.graph import Graph, Node, ValueKind
from draftgraph.runtime.ir.op_registry import get_op


@dataclass(frozen=True)
class Lifetime:
    value: str
    first: int  # step that defines the value
    last: int  # step of its last use (len(schedule) for graph outputs)

    @property
    def end(self) -> int:
        """One past the last step: the half-open interval is [first, end)."""
        return self.last + 1


def last_uses(graph: Graph, order: list[Node]) -> dict[str, int]:
    """Value name -> last step that reads it (jax's ``last_used``, by step index)."""
    last: dict[str, int] = {}
    for step, node in enumerate(order):
        for name in node.reads:
            last[name] = step
    for name in graph.outputs:
        last[name] = len(order)
    return last


def compute_lifetimes(graph: Graph, order: list[Node]) -> dict[str, Lifetime]:
    """Lifetime of every intermediate; an unused (discarded) output dies where it is born."""
    last = last_uses(graph, order)
    result: dict[str, Lifetime] = {}
    for step, node in enumerate(order):
        for name in node.outputs:
            result[name] = Lifetime(name, step, max(last.get(name, step), step))
    return result


@dataclass(frozen=True)
class AliasGroups:
    root: dict[str, str]  # arena value -> the value whose bytes it uses
    kind: dict[str, str]  # member -> "view" | "inplace" (roots absent)
    external_view: dict[str, str]  # view of a non-arena value (input/weight/state) -> that value

    def members(self, root: str) -> list[str]:
        return [v for v, r in self.root.items() if r == root]

    def declared_pairs(self) -> set[tuple[str, str]]:
        """Every pair of values allowed to share bytes (same group)."""
        groups: dict[str, list[str]] = {}
        for value, root in self.root.items():
            groups.setdefault(root, []).append(value)
        return {(a, b) for vs in groups.values() for a in vs for b in vs if a < b}


def alias_groups(graph: Graph, order: list[Node], lifetimes: dict[str, Lifetime]) -> AliasGroups:
    root: dict[str, str] = {}
    kind: dict[str, str] = {}
    external: dict[str, str] = {}
    group_last: dict[str, int] = {}
    outputs = set(graph.outputs)

    def is_arena(name: str) -> bool:
        return graph.values[name].kind == ValueKind.INTERMEDIATE and name not in external

    for step, node in enumerate(order):
        views, inplace = _declarations(node)
        for oi, out in enumerate(node.outputs):
            life = lifetimes[out]
            if oi in views:
                base = node.inputs[views[oi]]
                if not is_arena(base):
                    external[out] = external.get(base, base)
                    continue
                root[out] = root[base]
                kind[out] = "view"
            elif oi in inplace and _can_share(graph, node, inplace[oi], root, group_last, step, outputs):
                root[out] = root[node.inputs[inplace[oi]]]
                kind[out] = "inplace"
            else:
                root[out] = out
            r = root[out]
            group_last[r] = max(group_last.get(r, life.last), life.last)
    return AliasGroups(root, kind, external)


def _declarations(node: Node) -> tuple[dict[int, int], dict[int, int]]:
    """The node's (views, in-place reuses): an op's views always, its in-place pairs where allowed."""
    if node.subgraph is not None:
        return {}, {}
    opdef = get_op(node.op)
    return dict(opdef.views), dict(opdef.inplace) if node.may_reuse else {}


def _can_share(graph, node, input_index, root, group_last, step, outputs) -> bool:
    src = node.inputs[input_index]
    value = graph.values[src]
    if value.kind != ValueKind.INTERMEDIATE or src not in root:
        return False
    r = root[src]
    # The source's bytes may be reused only if nothing reads its group after this step,
    # and the group is not a graph output (the caller reads those after the run).
    if group_last.get(r, -1) != step:
        return False
    if any(m in outputs for m, mr in root.items() if mr == r):
        return False
    return True
