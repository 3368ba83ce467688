"""``draftgraph draw``: a picture of the draft chain graph (SVG or PNG).

With Graphviz (``dot`` on PATH) the picture is ``draftgraph.runtime.ir.dot.to_dot``
rendered by ``dot``. Without it (or with ``--engine matplotlib``) a layered
layout is drawn with matplotlib: one column per draft (``d0``, ``d1``, ...),
rows by dependency depth, the body of each draft as a labelled cluster, boxes
coloured by op family (``draftgraph.tools.colors``), edges labelled ``dtype[shape]``.
Inputs, weights and state are drawn apart from the data flow: as small tags on
the nodes that read them (``i3``, ``w7-14``, ``s1``), spelled out in a legend.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from draftgraph.tools.common import add_selectors

EXAMPLES = """examples:
  draftgraph draw --out chain.svg                    # K=3 chain; Graphviz when installed
  draftgraph draw --out docs/chain_k3.png --engine matplotlib
  draftgraph draw -k 1 --mode collapsed --out k1.png
"""

ENGINES = ("auto", "graphviz", "matplotlib")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "draw",
        help="draw the chain graph to an SVG or PNG file",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", "-o", type=Path, required=True, help="output file: .svg or .png, in an existing folder")
    add_selectors(p, batch=False)
    from draftgraph.tools.chain_select import add_shard_selectors

    add_shard_selectors(p)
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="auto = Graphviz when `dot` is on PATH, else matplotlib",
    )
    p.add_argument("--dpi", type=int, default=110, help="PNG resolution, >= 1 (matplotlib engine; default 110)")
    return p


def run(args) -> int:
    from draftgraph.runtime.errors import describe
    from draftgraph.runtime.ir.schedule import flatten
    from draftgraph.tools.arg_checks import check_output_file, picture_format
    from draftgraph.tools.chain_select import selected_graph
    from draftgraph.tools.cli import UsageError

    fmt = picture_format("--out", args.out)
    check_output_file("--out", args.out)
    if args.dpi < 1:
        raise UsageError(describe("--dpi", "a resolution >= 1 dots per inch", args.dpi, "the default is 110"))
    flat = flatten(selected_graph(args))
    engine = args.engine
    if engine == "auto":
        engine = "graphviz" if shutil.which("dot") else "matplotlib"
    if engine == "graphviz":
        if not shutil.which("dot"):
            raise UsageError(
                "--engine graphviz: `dot` is not on PATH (hint: apt-get install graphviz, "
                "or use --engine matplotlib)"
            )
        draw_graphviz(flat, args.out, fmt)
    else:
        draw_matplotlib(flat, args.out, dpi=args.dpi)
    print(f"wrote {args.out} ({len(flat.nodes)} nodes, {engine})", file=sys.stderr)
    return 0


def draw_graphviz(graph, out: Path, fmt: str) -> None:
    """Render ``to_dot(graph)`` with the ``dot`` binary."""
    from draftgraph.runtime.ir.dot import to_dot
    from draftgraph.tools.colors import graph_palette

    source = to_dot(graph, colors=graph_palette(graph))
    subprocess.run(["dot", f"-T{fmt}", "-o", str(out)], input=source.encode(), check=True)


def draw_matplotlib(graph, out: Path, dpi: int = 110) -> None:
    """Draw ``graph`` (flat) with the layered layout of :mod:`draftgraph.tools.draw_layout`."""
    from draftgraph.tools.draw_layout import layered_layout
    from draftgraph.tools.draw_render import render_layout

    render_layout(graph, layered_layout(graph), out, dpi=dpi)
