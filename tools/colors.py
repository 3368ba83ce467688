"""Stable colours for pictures: one per op family, the same in every run.

Known families (``OpDef.family``) have a fixed colour; any other family gets one
of a fixed list chosen by a hash of its name (crc32, not Python's salted ``hash``),
the way torch.fx's graph drawer keeps colours stable. Non-intermediate values
(inputs, weights, state) have their own fixed fills.

Example
-------
>>> from draftgraph.tools.colors import family_color
>>> family_color("attention")
'#f4a6a6'
"""

from __future__ import annotations

import zlib

# Pastels, dark enough to read black text on, distinct side by side.
FAMILY_COLORS: dict[str, str] = {
    "embed": "#b5d8f7",
    "norm": "#d9d9d9",
    "linear": "#a8e0c8",
    "mhc": "#c9b8f0",
    "attention": "#f4a6a6",
    "moe": "#f7c98b",
    "head": "#9fd3dc",
    "sample": "#f2e394",
    "elementwise": "#e4ecd0",
    "view": "#eeeeee",
    "runner": "#f0b8dc",
    "subgraph": "#f0b8dc",
    "comm": "#ff8c69",  # where ranks talk: meant to stand out
}

# For families not listed above, picked by crc32 of the family name.
FALLBACK_COLORS: tuple[str, ...] = (
    "#c6dbef",
    "#fdd0a2",
    "#c7e9c0",
    "#dadaeb",
    "#fcbba1",
    "#d9f0a3",
    "#bcbddc",
    "#fee391",
    "#a1d99b",
    "#fdae6b",
    "#9ecae1",
    "#e7cbe0",
)

KIND_COLORS: dict[str, str] = {
    "input": "#d6f5d6",
    "weight": "#fff3c4",
    "state": "#ffd6d6",
    "output": "#ffffff",
}


def family_color(family: str) -> str:
    """The fill colour of an op family: fixed for known ones, else a stable hash pick."""
    if family in FAMILY_COLORS:
        return FAMILY_COLORS[family]
    return FALLBACK_COLORS[zlib.crc32(family.encode()) % len(FALLBACK_COLORS)]


def node_family(op: str) -> str:
    """The family of an op name; unregistered ones (``subgraph``, a call) are their own family."""
    from draftgraph.runtime.errors import GraphError
    from draftgraph.runtime.ir.op_registry import get_op

    try:
        return get_op(op).family
    except GraphError:
        return op


def palette(families) -> dict[str, str]:
    """family -> colour for every family given (the ``colors`` argument of ``to_dot``)."""
    return {f: family_color(f) for f in sorted(set(families))}


def graph_palette(graph) -> dict[str, str]:
    """family -> colour for every op family used in ``graph``."""
    return palette(node_family(n.op) for n in graph.nodes.values())
