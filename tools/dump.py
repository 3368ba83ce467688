"""``draftgraph dump``: print the draft chain graph as text, JSON or Graphviz DOT.

The graph is the declared chain after the passes ``--passes`` names (all by default; ``none``
prints the graph as declared: the seven ops of each step, the body one node with its V4 block
indented below it). text: one line per pass saying what it changed, then the one printer
(``draftgraph.runtime.ir.printer.format_graph``) over the graph; where the graph is flat (its
subgraphs inlined) with its arena plan: each line's arena offset and bytes, the values freed
there, and a closing summary line. json: the same graph, loadable with
``draftgraph.runtime.ir.serialize.from_json``. dot: Graphviz source with the body as a cluster
and nodes coloured by op family (``draftgraph.tools.colors``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftgraph.tools.common import add_selectors

EXAMPLES = """examples:
  draftgraph dump                          # K=3 chain, streams mode, B=1, after every pass, with arena offsets
  draftgraph dump --passes none            # the graph as declared
  draftgraph dump -k 1 --batch 8
  draftgraph dump --format json --out chain.json
  draftgraph dump --format dot --out chain.dot && dot -Tsvg chain.dot -o chain.svg
  draftgraph dump --runner identity --mode collapsed
  draftgraph dump --world 2 --rank 1       # rank 1's graph of 2 ranks: where they talk (the comm nodes)
"""

FORMATS = ("text", "json", "dot")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "dump",
        help="print the chain graph (text with arena plan, json or dot)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--format", "-f", choices=FORMATS, default="text", help="output format (default text)")
    add_selectors(p)
    p.add_argument("--passes", default="all",
                   help="passes to run: all (default), none (the declared graph), or names, comma-separated")
    from draftgraph.tools.chain_select import add_shard_selectors

    add_shard_selectors(p)
    p.add_argument("--out", "-o", type=Path, default=None,
                   help="write to this file instead of stdout (its folder must exist)")
    return p


def render(args) -> str:
    """The dump as a string (what ``run`` prints or writes)."""
    from draftgraph.runtime.planning.graph_plan import plan_graph
    from draftgraph.tools.arg_checks import check_batch, check_output_file
    from draftgraph.tools.chain_select import selected_lowering

    batch = getattr(args, "batch", 1)
    check_batch(batch)
    check_output_file("--out", getattr(args, "out", None))
    lowered = selected_lowering(args)
    graph = lowered.graph
    if args.format == "json":
        from draftgraph.runtime.ir.serialize import dumps

        return dumps(graph) + "\n"
    plan = None if graph.has_subgraphs() else plan_graph(graph, batch)
    if args.format == "dot":
        from draftgraph.runtime.ir.dot import to_dot
        from draftgraph.tools.colors import graph_palette

        return to_dot(graph, plan.offsets if plan else None, colors=graph_palette(graph))
    from draftgraph.runtime.ir.printer import format_graph

    header = "".join(f"# pass {line}\n" for line in lowered.summaries) + comm_summary(graph, batch)
    return header + format_graph(graph, plan) + "\n"


def comm_summary(graph, batch: int) -> str:
    """``# rank r of W ...`` and one ``# comm`` line per collective (a rank's bytes at ``batch``); "" unsharded."""
    if "world" not in graph.meta:
        return ""
    from draftgraph.runtime.ir.op_registry import get_op
    from draftgraph.runtime.ir.schedule import flatten

    flat = flatten(graph)
    lines = [f"# rank {graph.meta['rank']} of {graph.meta['world']}: the ranks talk at the comm nodes below\n"]
    for node in flat.nodes.values():
        if get_op(node.op).family != "comm":
            continue
        x = flat.values[node.inputs[0]].spec
        sent = x.nbytes(batch) if node.op == "all_reduce_sum" else x.concrete(batch)[0] * 3 * 4  # triples
        group = node.attrs["group"]
        lines.append(f"# comm %{node.name} = {node.op}[group={group}]: {sent} bytes a rank at B={batch}\n")
    return "".join(lines)


def run(args) -> int:
    text = render(args)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out} ({len(text.splitlines())} lines, {args.format})", file=sys.stderr)
    return 0
