"""``draftgraph arena``: the plan as a picture or a table, for the chain and for MiniMalloc CSVs."""

from __future__ import annotations

import argparse
import re
import struct

from draftgraph.tools.arena import chain_view, format_table
from draftgraph.tools.chain_select import selected_chain
from draftgraph.tools.cli import main


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts the PNG signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path}: not a PNG ({head[:16]!r})"
    return struct.unpack(">II", head[16:24])


# id,lower,upper,size: half-open step intervals. a and b overlap in time; c reuses a's bytes.
TINY_CSV = """id,lower,upper,size
a,0,2,100
b,1,3,50
c,2,4,100
d,3,5,30
"""


def write_csv(path, text: str = TINY_CSV):
    path.write_text(text)
    return path


def parse_table(text: str) -> dict[str, tuple[int, int, int, int]]:
    """name -> (offset, bytes, first, last) from ``--format text``."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(\S+)\s+(0x[0-9a-f]+)\s+(\d+)\s+(\d+)\.\.(\d+)", line)
        if m:
            rows[m.group(1)] = (int(m.group(2), 16), int(m.group(3)), int(m.group(4)), int(m.group(5)))
    return rows


def assert_disjoint(rows: dict[str, tuple[int, int, int, int]], may_share=lambda a, b: False) -> None:
    """The independent oracle: values live at the same step never share a byte."""
    items = sorted(rows.items())
    for i, (a, (off_a, n_a, f_a, l_a)) in enumerate(items):
        for b, (off_b, n_b, f_b, l_b) in items[i + 1 :]:
            if f_a <= l_b and f_b <= l_a and off_a < off_b + n_b and off_b < off_a + n_a:
                assert may_share(a, b), f"{a} [{off_a},{off_a + n_a}) and {b} [{off_b},{off_b + n_b}) overlap"


# ---- the chain ----------------------------------------------------------------------------------


def test_chain_picture_is_well_formed(tmp_path):
    out = tmp_path / "arena_k1.png"
    assert main(["arena", "-k", "1", "--out", str(out)]) == 0
    width, height = png_size(out)
    assert width >= 1000 and height >= 600, (width, height)


def test_chain_table_lists_every_arena_value(capsys):
    args = argparse.Namespace(num_drafts=1, batch=2, mode="streams", runner="builtin", checkpoint=None)
    flat, plan = selected_chain(args)
    capsys.readouterr()
    assert main(["arena", "--format", "text", "-k", "1", "--batch", "2"]) == 0
    text = capsys.readouterr().out
    rows = parse_table(text)
    assert set(plan.offsets) <= set(rows), sorted(set(plan.offsets) - set(rows))
    for name, offset in plan.offsets.items():
        life = plan.lifetimes[name]
        assert rows[name] == (offset, plan.nbytes(name), life.first, life.last), name
    assert text.rstrip().splitlines()[-1] == f"{plan.summary()} at B=2"
    pairs = plan.groups.declared_pairs()
    assert_disjoint(
        {k: v for k, v in rows.items() if k in plan.offsets},
        may_share=lambda a, b: (min(a, b), max(a, b)) in pairs,
    )


def test_chain_view_buffers_match_the_arena_plan():
    args = argparse.Namespace(num_drafts=3, batch=1, mode="streams", runner="builtin", checkpoint=None)
    flat, plan = selected_chain(args)
    view = chain_view(flat, plan)
    assert len(view.buffers) == len(plan.arena.buffers)
    assert view.arena_bytes == plan.arena_bytes and view.lower_bound <= view.arena_bytes <= view.naive_bytes
    assert max(r.offset + r.nbytes for r in view.buffers) <= view.arena_bytes
    assert "d0.body.attn" in format_table(view)


# ---- MiniMalloc CSVs -------------------------------------------------------------------------------


def test_csv_table_is_a_valid_packing(tmp_path, capsys):
    csv = write_csv(tmp_path / "tiny.csv")
    capsys.readouterr()
    assert main(["arena", "--csv", str(csv), "--format", "text"]) == 0
    text = capsys.readouterr().out
    rows = parse_table(text)
    assert {k: v[1:] for k, v in rows.items()} == {
        "a": (100, 0, 1),
        "b": (50, 1, 2),
        "c": (100, 2, 3),
        "d": (30, 3, 4),
    }
    assert_disjoint(rows)
    arena = max(off + n for off, n, _, _ in rows.values())
    assert re.search(r"arena", text.splitlines()[-1]) and arena >= 150  # a and b are live together


def test_csv_picture(tmp_path):
    csv = write_csv(tmp_path / "tiny.csv")
    out = tmp_path / "tiny.png"
    assert main(["arena", "--csv", str(csv), "--out", str(out)]) == 0
    assert min(png_size(out)) > 0


def test_csv_folder_plans_every_file(tmp_path, capsys):
    folder = tmp_path / "problems"
    folder.mkdir()
    write_csv(folder / "one.csv")
    write_csv(folder / "two.csv", "id,lower,upper,size\nx,0,1,8\ny,0,1,8\n")
    out = tmp_path / "pictures"
    assert main(["arena", "--csv", str(folder), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["one.png", "two.png"]
    capsys.readouterr()
    assert main(["arena", "--csv", str(folder), "--format", "text"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["one.csv", "two.csv"], lines


def test_usage_errors(tmp_path, capsys):
    assert main(["arena", "-k", "1"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["arena", "--csv", str(tmp_path / "missing.csv"), "--format", "text"]) == 2
    assert "not found" in capsys.readouterr().err


def test_csv_capacity_from_benchmark_name(tmp_path, capsys):
    csv = write_csv(tmp_path / "tiny.1000.csv")
    capsys.readouterr()
    assert main(["arena", "--csv", str(csv), "--format", "text"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("capacity 1000 B (fits)")
    assert main(["arena", "--csv", str(csv), "--out", str(tmp_path / "tiny.png")]) == 0


def test_malformed_csv_is_a_one_line_error(tmp_path, capsys):
    csv = write_csv(tmp_path / "bad.csv", "id,lower,upper,size\na,3,1,8\n")
    assert main(["arena", "--csv", str(csv), "--format", "text"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "PlanError" in err and "bad.csv:2" in err, err
