"""plan_graph(): the arena plan of a graph at one batch size.

Derives lifetimes from the deterministic schedule, merges declared aliases
into groups, adds each node's declared workspace as a one-step buffer, and
hands the intervals to the planner (:func:`draftgraph.runtime.planning.arena_plan.plan_arena`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftgraph.runtime.ir.graph import Graph, Node
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.schedule import schedule
from draftgraph.runtime.planning.arena_plan import ArenaPlan, Buffer, format_bytes_short, plan_arena
from draftgraph.runtime.planning.lifetimes import AliasGroups, Lifetime, alias_groups, compute_lifetimes
from draftgraph.runtime.planning.verify_plan import verify_plan

DEFAULT_ALIGNMENT = 256


@dataclass
class GraphPlan:
    """Where every intermediate lives in the arena at ``batch``."""

    graph: Graph
    batch: int
    order: list[str]  # node names in schedule order
    arena: ArenaPlan
    offsets: dict[str, int]  # arena value -> byte offset (members share their root's)
    lifetimes: dict[str, Lifetime]
    groups: AliasGroups
    workspace: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (offset, bytes)
    frees: dict[str, list[str]] = field(default_factory=dict)  # node -> values whose bytes die there

    @property
    def arena_bytes(self) -> int:
        return self.arena.arena_bytes

    def nbytes(self, value: str) -> int:
        return self.graph.values[value].spec.nbytes(self.batch)

    def summary(self) -> str:
        return self.arena.summary()

    def summary_line(self) -> str:
        """The printer's closing line: the arena summary at this plan's batch."""
        return f"{self.summary()} at B={self.batch}"

    def comment(self, graph: Graph, node: Node) -> str:
        """The printer's comment on ``node``: where each output lives, and what dies there."""
        parts = []
        for name in node.outputs:
            if name in self.groups.external_view:
                parts.append(f"view of {graph.values[self.groups.external_view[name]].ref}")
            elif self.groups.kind.get(name) == "view":
                parts.append(f"view of %{self.groups.root[name]}")
            elif self.groups.kind.get(name) == "inplace":
                parts.append(f"in place of %{self.groups.root[name]}")
            elif name in self.offsets:
                parts.append(f"arena +{self.offsets[name]:#x} {format_bytes_short(self.nbytes(name))}")
        if node.name in self.workspace:
            offset, nbytes = self.workspace[node.name]
            parts.append(f"ws +{offset:#x} {format_bytes_short(nbytes)}")
        text = "  # " + ", ".join(parts)
        freed = self.frees.get(node.name, [])
        if freed:
            text += "  free " + " ".join(f"%{v}" for v in freed)
        return text

    def value_buffers(self) -> list[Buffer]:
        """One Buffer per arena value (not per group), for value-level verification."""
        out = []
        for name, life in self.lifetimes.items():
            if name in self.offsets:
                out.append(Buffer(name, life.first, life.end, max(self.nbytes(name), 1)))
        return out


def plan_graph(
    graph: Graph, batch: int, alignment: int = DEFAULT_ALIGNMENT, time_limit_s: float = 0.5
) -> GraphPlan:
    order = schedule(graph)
    lifetimes = compute_lifetimes(graph, order)
    groups = alias_groups(graph, order, lifetimes)

    spans: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for value, root in groups.root.items():
        life = lifetimes[value]
        span = spans.setdefault(root, [life.first, life.end])
        span[0], span[1] = min(span[0], life.first), max(span[1], life.end)
        sizes[root] = max(sizes.get(root, 1), graph.values[value].spec.nbytes(batch))
    buffers = [Buffer(r, s, e, sizes[r]) for r, (s, e) in spans.items()]

    ws_names: dict[str, str] = {}
    for step, node in enumerate(order):
        nbytes = _workspace_bytes(graph, node, batch)
        if nbytes > 0:
            ws_names[node.name] = f"{node.name}.workspace"
            buffers.append(Buffer(ws_names[node.name], step, step + 1, nbytes))

    arena = plan_arena(buffers, alignment=alignment, time_limit_s=time_limit_s)
    verify_plan(arena, buffers)

    offsets = {value: arena.offsets[root] for value, root in groups.root.items()}
    workspace = {n: (arena.offsets[b], _size(buffers, b)) for n, b in ws_names.items()}
    frees: dict[str, list[str]] = {}
    for root, (_, end) in spans.items():
        if end - 1 < len(order):
            frees.setdefault(order[end - 1].name, []).extend(sorted(groups.members(root)))
    return GraphPlan(graph, batch, [n.name for n in order], arena, offsets, lifetimes, groups, workspace, frees)


def _workspace_bytes(graph: Graph, node, batch: int) -> int:
    if node.subgraph is not None:  # its own nodes declare theirs once inlined
        return 0
    specs = [graph.values[n].spec for n in node.inputs]
    return get_op(node.op).workspace_bytes(specs, node.attrs, batch)


def _size(buffers: list[Buffer], name: str) -> int:
    return next(b.size for b in buffers if b.name == name)

