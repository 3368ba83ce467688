"""``draftgraph dump``: print the draft chain graph as text, JSON or Graphviz DOT.

text: the one printer (``draftgraph.runtime.ir.printer.format_graph``) over the flattened chain
with its arena plan: each line's arena offset and bytes, the values freed there,
and a closing summary line. json: the graph as built (the body still a subgraph
node), loadable with ``draftgraph.runtime.ir.serialize.from_json``. dot: Graphviz source with
the body as a cluster and nodes coloured by op family (``draftgraph.tools.colors``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftgraph.tools.common import add_selectors

EXAMPLES = """examples:
  draftgraph dump                          # K=3 chain, streams mode, B=1, with arena offsets
  draftgraph dump -k 1 --batch 8
  draftgraph dump --format json --out chain.json
  draftgraph dump --format dot --out chain.dot && dot -Tsvg chain.dot -o chain.svg
  draftgraph dump --runner identity --mode collapsed
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
    p.add_argument("--out", "-o", type=Path, default=None, help="write to this file instead of stdout")
    return p


def render(args) -> str:
    """The dump as a string (what ``run`` prints or writes)."""
    from draftgraph.tools.chain_select import selected_chain, selected_graph

    if args.format == "json":
        from draftgraph.runtime.ir.serialize import dumps

        return dumps(selected_graph(args)) + "\n"
    flat, plan = selected_chain(args)
    if args.format == "dot":
        from draftgraph.runtime.ir.dot import to_dot
        from draftgraph.tools.colors import graph_palette

        return to_dot(flat, plan.offsets, colors=graph_palette(flat))
    from draftgraph.runtime.ir.printer import format_graph

    return format_graph(flat, plan) + "\n"


def run(args) -> int:
    text = render(args)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out} ({len(text.splitlines())} lines, {args.format})", file=sys.stderr)
    return 0
