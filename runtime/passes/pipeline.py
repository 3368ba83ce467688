"""The pass pipeline: which passes run, in what order, and the summary line each one prints.

A pass is a pure function ``Graph -> (Graph, summary)``: it never edits its input (it works on
``graph.copy()``), and its summary says in one line what it changed, as tinygrad's passes do.
``run_passes`` validates the graph after every pass, so a pass that breaks a graph is named in
the error. The default order matters: subgraphs are inlined first, so the rewrites after it see
the body's nodes; the in-place pass runs last, on the final nodes.

Example
-------
>>> lowered = run_passes(graph)                                   # doctest: +SKIP
>>> print("\\n".join(lowered.summaries))                           # doctest: +SKIP
inline_subgraphs: 3 subgraphs inlined (24 nodes)
...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from draftgraph.runtime.errors import GraphError, describe
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.validate import validate
from draftgraph.runtime.passes.fold_embed_into_combiner import fold_embed_into_combiner
from draftgraph.runtime.passes.fold_hc_expand import fold_hc_expand
from draftgraph.runtime.passes.fold_norm_into_hc_pre import fold_norm_into_hc_pre
from draftgraph.runtime.passes.inline_subgraphs import inline_subgraphs
from draftgraph.runtime.passes.reuse_dying_inputs import reuse_dying_inputs
from draftgraph.runtime.passes.view_single_stacks import view_single_stacks


@dataclass(frozen=True)
class Pass:
    """A named rewrite: ``run(graph)`` answers the new graph and one line saying what changed."""

    name: str
    run: Callable[[Graph], tuple[Graph, str]]


@dataclass(frozen=True)
class Lowered:
    """A graph after its passes, and each pass's summary line (``name: what it did``)."""

    graph: Graph
    summaries: list[str]


DEFAULT_PASSES: tuple[Pass, ...] = (
    Pass("inline_subgraphs", inline_subgraphs),
    Pass("fold_hc_expand", fold_hc_expand),
    Pass("fold_embed_into_combiner", fold_embed_into_combiner),
    Pass("fold_norm_into_hc_pre", fold_norm_into_hc_pre),
    Pass("view_single_stacks", view_single_stacks),
    Pass("reuse_dying_inputs", reuse_dying_inputs),
)
PASSES_BY_NAME = {p.name: p for p in DEFAULT_PASSES}


def run_passes(graph: Graph, passes: Sequence[Pass] = DEFAULT_PASSES) -> Lowered:
    """Apply ``passes`` in order to ``graph`` (left unchanged); validate after each."""
    summaries = []
    for p in passes:
        graph, summary = p.run(graph)
        try:
            validate(graph)
        except GraphError as exc:
            raise GraphError(f"after pass {p.name}: {exc}") from exc
        summaries.append(f"{p.name}: {summary}")
    return Lowered(graph, summaries)


def parse_passes(text: str) -> tuple[Pass, ...]:
    """``all`` (the default pipeline), ``none``, or names from it, comma-separated, run in its order."""
    if text == "all":
        return DEFAULT_PASSES
    if text == "none":
        return ()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES_BY_NAME]
    if unknown or not names:
        raise GraphError(describe("passes", f"'all', 'none' or names from {list(PASSES_BY_NAME)}", repr(text)))
    return tuple(p for p in DEFAULT_PASSES if p.name in names)
