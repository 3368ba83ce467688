"""``draftgraph draw``: well-formed pictures, stable colours, and a layout that stays readable."""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.tools.chain_select import selected_graph
from draftgraph.tools.cli import main
from draftgraph.tools.colors import FALLBACK_COLORS, FAMILY_COLORS, family_color
from draftgraph.tools.draw_layout import BOX_H, BOX_W, layered_layout

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path}: not a PNG (starts {head[:8]!r})"
    assert head[12:16] == b"IHDR", f"{path}: first chunk is {head[12:16]!r}, expected IHDR"
    return struct.unpack(">II", head[16:24])


def chain(num_drafts: int = 3, mode: str = "streams", runner: str = "builtin"):
    args = argparse.Namespace(num_drafts=num_drafts, mode=mode, runner=runner, checkpoint=None)
    return flatten(selected_graph(args))


# ---- files ----------------------------------------------------------------------------------


def test_matplotlib_png_is_well_formed(tmp_path):
    out = tmp_path / "k1.png"
    assert main(["draw", "-k", "1", "--engine", "matplotlib", "--out", str(out)]) == 0
    width, height = png_size(out)
    assert width > 500 and height > 500, (width, height)
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (height, width)


def test_matplotlib_svg_parses(tmp_path):
    out = tmp_path / "k1.svg"
    assert main(["draw", "-k", "1", "--runner", "identity", "--engine", "matplotlib", "--out", str(out)]) == 0
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg") and out.stat().st_size > 1000


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_graphviz_svg_parses(tmp_path):
    out = tmp_path / "k1_dot.svg"
    assert main(["draw", "-k", "1", "--engine", "graphviz", "--out", str(out)]) == 0
    text = out.read_text()
    assert ET.fromstring(text).tag.endswith("svg") and "d0.body" in text


def test_bad_suffix_is_a_usage_error(tmp_path, capsys):
    assert main(["draw", "--out", str(tmp_path / "chain.jpg")]) == 2
    err = capsys.readouterr().err
    assert ".svg or .png" in err and err.count("\n") == 1, err


# ---- colours --------------------------------------------------------------------------------


def test_known_families_have_fixed_distinct_colours():
    assert family_color("attention") == FAMILY_COLORS["attention"]
    main_families = ["embed", "norm", "linear", "mhc", "attention", "moe", "head", "sample"]
    assert len({family_color(f) for f in main_families}) == len(main_families)


def test_fallback_colour_is_stable_across_processes():
    code = "from draftgraph.tools.colors import family_color; print(family_color('quantize'), family_color('zz_new'))"
    root = Path(__file__).resolve().parents[1]
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=root,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1, outs
    assert outs.pop().split() == [family_color("quantize"), family_color("zz_new")]
    assert family_color("quantize") in FALLBACK_COLORS


# ---- layout readability -----------------------------------------------------------------------


def _rect(box, shrink: float = 0.0):
    return (
        box.x - BOX_W / 2 + shrink,
        box.y - BOX_H / 2 + shrink,
        box.x + BOX_W / 2 - shrink,
        box.y + BOX_H / 2 - shrink,
    )


def _segment_hits(p, q, rect) -> bool:
    """Liang-Barsky: does segment p-q pass through the open rectangle?"""
    x0, y0, x1, y1 = rect
    t0, t1 = 0.0, 1.0
    dx, dy = q[0] - p[0], q[1] - p[1]
    for d, lo, hi, s in ((dx, x0, x1, p[0]), (dy, y0, y1, p[1])):
        if abs(d) < 1e-12:
            if not lo < s < hi:
                return False
            continue
        a, b = (lo - s) / d, (hi - s) / d
        t0, t1 = max(t0, min(a, b)), min(t1, max(a, b))
    return t0 < t1


@pytest.mark.parametrize("num_drafts,mode", [(3, "streams"), (2, "collapsed")])
def test_layout_boxes_do_not_overlap_and_edges_avoid_boxes(num_drafts, mode):
    graph = chain(num_drafts, mode)
    layout = layered_layout(graph)
    assert set(layout.boxes) == set(graph.nodes)
    boxes = list(layout.boxes.values())
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            overlap_x = abs(a.x - b.x) < BOX_W + 0.05
            overlap_y = abs(a.y - b.y) < BOX_H + 0.05
            assert not (overlap_x and overlap_y), f"{a.name} and {b.name} overlap"
    for edge in layout.edges:
        for p, q in zip(edge.points, edge.points[1:]):
            for box in boxes:
                if box.name in (edge.src, edge.dst):
                    continue
                assert not _segment_hits(p, q, _rect(box, 0.01)), f"{edge.src}->{edge.dst} crosses {box.name}"


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_layout_every_value_is_labelled_with_its_type(num_drafts):
    """Each value's edges carry its dtype[shape] once (or a same-typed edge into the same node does)."""
    graph = chain(num_drafts)
    layout = layered_layout(graph)
    for edge in layout.edges:
        want = ", ".join(graph.values[v].spec.short() for v in edge.values)
        siblings = [e.label for e in layout.edges if (e.src, e.values) == (edge.src, edge.values)]
        into_same = [e.label for e in layout.edges if e.dst == edge.dst]
        assert want in siblings or want in into_same, (edge.src, edge.dst, want)
    body = [c for c in layout.clusters if c[0] == "d0.body"]
    assert len(body) == 1
    _, x0, y0, x1, y1 = body[0]
    for name, box in layout.boxes.items():
        if graph.nodes[name].scope == "d0.body":
            assert x0 < box.x - BOX_W / 2 and box.x + BOX_W / 2 < x1 and y0 < box.y < y1, name
