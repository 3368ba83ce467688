"""A layered layout of a flat graph for the matplotlib drawer (no Graphviz needed).

Columns are the leading name component of a node (``d0``, ``d1``, ...; nodes with
no prefix share one column), rows are the longest in-column dependency depth.
A node sits under its first in-column input, so the main path of each draft is
one straight spine. Edges never pass through a box:

- an edge to the next row is a straight line in the gap between the two rows;
- a longer in-column edge (a residual) leaves into the gap below its source,
  runs down a bypass track right of the column and enters the gap above its target;
- an edge between columns does the same through a gutter track between columns.

Tracks are assigned by interval colouring, so parallel lines never overlap.
Units are inches (the renderer draws at 1 unit = 1 inch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LANE = 1.75  # horizontal pitch of node boxes
BOX_W = 1.5
BOX_H = 0.62
ROW = 1.2  # vertical pitch of rows
TRACK = 0.2  # spacing of parallel vertical tracks
SLOT = 0.1  # spacing of parallel horizontal segments in a gap
GAP_MARGIN = 0.06  # clearance between a box and the first horizontal segment
LABEL_ROOM = 0.16  # kept free mid-gap for the labels of straight edges
TOP = 1.1  # y of the first row's top edge
COLUMN_GAP = 0.35


@dataclass
class Box:
    name: str
    x: float  # centre
    y: float  # centre, growing downward
    column: str
    row: int


@dataclass
class Edge:
    src: str
    dst: str
    values: list[str]
    points: list[tuple[float, float]]
    label: str  # dtype[shape] of the values carried ("" when a sibling edge already says it)
    label_at: tuple[float, float]
    label_rotation: float = 0.0
    via_bypass: bool = False  # routed down a track right of its column


@dataclass
class Layout:
    boxes: dict[str, Box]
    edges: list[Edge]
    clusters: list[tuple[str, float, float, float, float]]  # scope, x0, y0, x1, y1
    width: float
    height: float
    columns: list[str] = field(default_factory=list)


def column_of(name: str) -> str:
    return name.split(".", 1)[0] if "." in name else ""


def short_name(name: str, scope: str) -> str:
    """``d0.body.attn`` in scope ``d0.body`` -> ``attn``; ``d0.embed`` -> ``embed``."""
    if scope and name.startswith(scope + "."):
        return name[len(scope) + 1 :]
    column = column_of(name)
    return name[len(column) + 1 :] if column else name


def layered_layout(graph) -> Layout:
    from draftgraph.runtime.ir.schedule import schedule

    order = [n.name for n in schedule(graph)]
    index = {n: i for i, n in enumerate(order)}
    g = graph.to_networkx()
    data = [(u, v, d["values"]) for u, v, d in g.edges(data=True) if d.get("kind") == "data"]
    preds: dict[str, list[str]] = {n: [] for n in order}
    for u, v, _ in data:
        preds[v].append(u)

    columns: list[str] = []
    for name in order:
        if column_of(name) not in columns:
            columns.append(column_of(name))
    row: dict[str, int] = {}
    for name in order:
        col = column_of(name)
        ranks = [row[p] + 1 for p in preds[name] if column_of(p) == col or col == ""]
        row[name] = max(ranks, default=0)

    lane = _place_lanes(graph, order, row)
    long_in_column = [(u, v) for u, v, _ in data if column_of(u) == column_of(v) and row[v] - row[u] > 1]
    # Pass 1 gives every long edge a bypass track; routing then shows which ones found a free
    # lane instead, and pass 2 reserves tracks only for the others (the choice is the same).
    # Crowded gaps (many horizontal segments) are then made taller in pass 2.
    layout, slots = _assemble(graph, order, index, columns, row, lane, data, set(long_in_column), {})
    used = {(e.src, e.dst) for e in layout.edges if e.via_bypass}
    room = ROW - BOX_H - 2 * GAP_MARGIN - LABEL_ROOM
    extra = {g: n * SLOT - room for g, n in slots.items() if n * SLOT > room}
    return _assemble(graph, order, index, columns, row, lane, data, used, extra)[0]


def _assemble(
    graph, order, index, columns, row, lane, data, bypassed, extra
) -> tuple[Layout, dict[int, int]]:
    boxes: dict[str, Box] = {}
    num_rows = max(row.values()) + 1
    row_top = [TOP + r * ROW + sum(extra.get(g, 0.0) for g in range(r + 1)) for r in range(num_rows + 1)]
    x0 = 0.4
    crossing = [(u, v) for u, v, _ in data if column_of(u) != column_of(v)]
    bypass_x: dict[tuple[str, str], float] = {}
    gutter_x: dict[tuple[str, str], float] = {}
    for col in columns:
        members = [n for n in order if column_of(n) == col]
        base = min(lane[n] for n in members)
        for n in members:
            boxes[n] = Box(
                n, x0 + BOX_W / 2 + (lane[n] - base) * LANE, row_top[row[n]] + BOX_H / 2, col, row[n]
            )
        right = max(boxes[n].x for n in members) + BOX_W / 2
        mine = sorted((u, v) for u, v in bypassed if column_of(u) == col)
        tracks = _interval_tracks([(row[u], row[v]) for u, v in mine])
        for (u, v), t in zip(mine, tracks):
            bypass_x[(u, v)] = right + 0.2 + t * TRACK
        right += 0.2 + (max(tracks) + 1) * TRACK if tracks else 0.0
        leaving = [(u, v) for u, v in crossing if column_of(u) == col]
        for t, (u, v) in enumerate(sorted(leaving, key=lambda e: (index[e[0]], index[e[1]]))):
            gutter_x[(u, v)] = right + 0.25 + t * TRACK
        right += 0.25 + len(leaving) * TRACK if leaving else 0.0
        x0 = right + COLUMN_GAP

    edges, slots = _route(graph, data, boxes, bypass_x, gutter_x, index, row_top)
    clusters = _clusters(graph, boxes, edges)
    height = max(b.y for b in boxes.values()) + BOX_H / 2 + 0.5
    return Layout(boxes, edges, clusters, x0, height, columns), slots


def _place_lanes(graph, order, row) -> dict[str, float]:
    """Each node under its first in-column input; collisions pushed right, one lane apart."""
    lane: dict[str, float] = {}
    position = {name: i for i, name in enumerate(order)}
    by_row: dict[tuple[str, int], list[str]] = {}
    for name in order:
        by_row.setdefault((column_of(name), row[name]), []).append(name)
    for (col, _), names in sorted(by_row.items()):  # rows top-down: anchors are placed first
        desired = {}
        for name in names:
            node = graph.nodes[name]
            anchors = [
                graph.values[i].producer
                for i in node.inputs
                if graph.values[i].producer in lane and column_of(graph.values[i].producer) == col
            ]
            desired[name] = lane[anchors[0]] if anchors else None
        placed: list[float] = []
        free = 0.0
        for name in sorted(names, key=lambda n: (desired[n] is None, desired[n] or 0.0, position[n])):
            want = desired[name] if desired[name] is not None else free
            x = max([want] + [p + 1.0 for p in placed])
            lane[name] = x
            placed.append(x)
            free = max(placed) + 1.0
    return lane


def _interval_tracks(spans: list[tuple[int, int]]) -> list[int]:
    """Lowest free track per closed interval, so that overlapping intervals differ."""
    tracks: list[int] = [0] * len(spans)
    busy: list[list[tuple[int, int]]] = []
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        lo, hi = spans[i]
        for t, used in enumerate(busy):
            if all(hi < a or lo > b for a, b in used):
                used.append((lo, hi))
                tracks[i] = t
                break
        else:
            busy.append([(lo, hi)])
            tracks[i] = len(busy) - 1
    return tracks


def _route(graph, data, boxes, bypass_x, gutter_x, index, row_top) -> tuple[list[Edge], dict[int, int]]:
    # A gap (keyed by the row below it) has two pools of horizontal slots: under the row
    # above (edges leaving it) and over the row below (edges entering it), so that the
    # middle stays free for the labels of straight edges. Segments whose x ranges are
    # apart may share a slot.
    used: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    verticals: list[tuple[float, float, float, str]] = []  # x, y0, y1, source: lanes already taken
    labelled: set[tuple[str, tuple[str, ...]]] = set()

    def take(gap: int, side: str, xa: float, xb: float) -> float:
        lo, hi = min(xa, xb) - 0.1, max(xa, xb) + 0.1
        pool = used.setdefault((gap, side), [])
        k = 0
        while any(slot == k and lo < b and a < hi for slot, a, b in pool):
            k += 1
        pool.append((k, lo, hi))
        if side == "top":
            top = row_top[gap - 1] + BOX_H if gap > 0 else row_top[0] - ROW + BOX_H
            return top + GAP_MARGIN + (k + 0.5) * SLOT
        return row_top[gap] - GAP_MARGIN - (k + 0.5) * SLOT

    def lane_free(x: float, col: str, row0: int, row1: int, y0: float, y1: float, src: str) -> bool:
        if any(
            b.column == col and row0 < b.row < row1 and abs(b.x - x) < BOX_W / 2 + 0.05
            for b in boxes.values()
        ):
            return False
        return not any(
            abs(vx - x) < 0.05 and min(y1, b1) > max(y0, a0) and s != src for vx, a0, b1, s in verticals
        )

    edges = []
    for u, v, values in sorted(data, key=lambda e: (index[e[0]], index[e[1]])):
        s, t = boxes[u], boxes[v]
        start, end = (s.x, s.y + BOX_H / 2), (t.x, t.y - BOX_H / 2)
        label_at, rotation = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2), 0.0
        if t.row == s.row + 1 and s.column == t.column:
            points = [start, end]
        elif s.column == t.column and lane_free(s.x, s.column, s.row, t.row, start[1], end[1], u):
            y_in = end[1] if s.x == t.x else take(t.row, "bottom", s.x, t.x)
            points = [start, (s.x, y_in), (t.x, y_in), end]
            verticals.append((s.x, start[1], y_in, u))
            label_at = (s.x, (start[1] + y_in) / 2)
        elif s.column == t.column and lane_free(t.x, s.column, s.row, t.row, start[1], end[1], u):
            y_out = take(s.row + 1, "top", s.x, t.x)
            points = [start, (s.x, y_out), (t.x, y_out), end]
            verticals.append((t.x, y_out, end[1], u))
            label_at = (t.x, (y_out + end[1]) / 2)
        else:
            track = bypass_x[(u, v)] if s.column == t.column else gutter_x[(u, v)]
            if t.row == s.row + 1:  # one gap: a single horizontal segment
                y_out = y_in = take(t.row, "top", min(s.x, t.x, track), max(s.x, t.x, track))
            else:
                y_out, y_in = take(s.row + 1, "top", s.x, track), take(t.row, "bottom", track, t.x)
            points = [start, (s.x, y_out), (track, y_out), (track, y_in), (t.x, y_in), end]
            label_at, rotation = (track, (y_out + y_in) / 2), 90.0
            if abs(y_in - y_out) < 1.2:  # too short to hold a label upright
                label_at, rotation = ((track + t.x) / 2, y_in), 0.0
        label = ", ".join(graph.values[n].spec.short() for n in values)
        # one label per value leaving a node, and per type entering a node from other columns
        seen = (u, tuple(values)) in labelled or (s.column != t.column and (v, label) in labelled)
        if seen:
            label = ""
        else:
            labelled.update({(u, tuple(values)), (v, label)})
        bypass = s.column == t.column and len(points) == 6
        edges.append(Edge(u, v, list(values), _dedupe(points), label, label_at, rotation, bypass))
    slots: dict[int, int] = {}
    for (gap, _), pool in used.items():
        slots[gap] = slots.get(gap, 0) + 1 + max(k for k, _, _ in pool)
    return edges, slots


def _dedupe(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = [points[0]]
    for p in points[1:]:
        if abs(p[0] - out[-1][0]) > 1e-9 or abs(p[1] - out[-1][1]) > 1e-9:
            out.append(p)
    return out


def _clusters(graph, boxes, edges) -> list[tuple[str, float, float, float, float]]:
    """One rectangle per scope around its boxes and the tracks of its internal edges."""
    out = []
    scopes: dict[str, list[str]] = {}
    for node in graph.nodes.values():
        if node.scope:
            scopes.setdefault(node.scope, []).append(node.name)
    for scope, names in scopes.items():
        members = set(names)
        xs = [boxes[n].x for n in names]
        ys = [boxes[n].y for n in names]
        x1 = max(xs) + BOX_W / 2 + 0.12
        for e in edges:
            if e.src in members and e.dst in members:
                x1 = max(x1, max(x for x, _ in e.points) + 0.12)
        out.append(
            (scope, min(xs) - BOX_W / 2 - 0.12, min(ys) - BOX_H / 2 - 0.3, x1, max(ys) + BOX_H / 2 + 0.12)
        )
    return out
