"""``draftgraph arena``: the arena plan as a picture (or a table).

x is the schedule step, y the byte offset: one rectangle per buffer over the
steps it is live, labelled when the label fits, coloured by the op family of
the node that makes it (workspaces hatched). A dashed line marks the lower
bound (the most bytes live at once), a solid one the planned arena size; the
naive size (every buffer apart) is in the title. ``--format text`` prints one
row per value instead: offset, bytes, first..last step.

The plan is the draft chain's (selectors as in ``dump``) or, with ``--csv``, a
MiniMalloc-format problem (``id,lower,upper,size``, half-open steps) planned
with ``plan_arena`` at alignment 1. ``--csv`` may name a folder: every ``*.csv``
in it is planned (with a progress bar); pictures then go into the ``--out`` folder.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from draftgraph.tools.common import add_selectors

EXAMPLES = """examples:
  draftgraph arena --out arena.png                   # K=3 chain at B=1
  draftgraph arena --format text -k 1 --batch 8
  draftgraph arena --csv problem.csv --out problem.png
  draftgraph arena --csv benchmarks/ --out pictures/ # every *.csv in a folder
"""


@dataclass(frozen=True)
class Row:
    """One value (or buffer) of a plan: where it lives and when."""

    name: str
    offset: int
    nbytes: int
    first: int  # first step live
    last: int  # last step live (inclusive)
    note: str = ""  # "view of %x", "in place of %x", "workspace"
    family: str = ""  # op family of the producer, for the colour
    footprint: int = 0  # bytes reserved (size rounded up to the alignment)


@dataclass(frozen=True)
class ArenaView:
    """What the picture and the table show: buffers placed in time and bytes."""

    title: str
    buffers: list[Row]  # one per arena buffer (a group root or a workspace)
    values: list[Row]  # one per value, for the table
    arena_bytes: int
    naive_bytes: int
    lower_bound: int
    num_steps: int
    summary: str
    capacity: int | None = None  # a benchmark's capacity (from names like A.1048576.csv)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "arena",
        help="draw the arena plan (or print it as a table)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", "-o", type=Path, default=None, help="picture file (.png or .svg); a folder with --csv DIR"
    )
    p.add_argument(
        "--format",
        "-f",
        choices=("png", "text"),
        default="png",
        help="png: a picture in --out (default); text: a table on stdout (or --out)",
    )
    add_selectors(p)
    p.add_argument(
        "--csv",
        type=Path,
        default=None,
        help="plan a MiniMalloc CSV (id,lower,upper,size) or every *.csv in a folder instead",
    )
    p.add_argument("--time-limit", type=float, default=1.0,
                   help="planner time limit per CSV, seconds (finite, > 0; default 1)")
    return p


# ---- building the view ------------------------------------------------------------------------


def chain_view(flat, plan) -> ArenaView:
    from draftgraph.tools.colors import node_family

    family = {o: node_family(n.op) for n in flat.nodes.values() for o in n.outputs}
    groups = plan.groups
    workspace_of = {f"{node}.workspace": node for node in plan.workspace}
    buffers = []
    for b in plan.arena.buffers:
        members = groups.members(b.name) if b.name in groups.root else []
        label = b.name if len(members) <= 1 else f"{b.name} (+{len(members) - 1})"
        note = "workspace" if b.name in workspace_of else ""
        buffers.append(
            Row(
                label,
                plan.arena.offsets[b.name],
                b.size,
                b.start,
                b.end - 1,
                note,
                family.get(b.name, "workspace"),
                _aligned(b.size, plan.arena.alignment),
            )
        )
    values = []
    for name, life in plan.lifetimes.items():
        if name not in plan.offsets:
            continue
        kind = groups.kind.get(name)
        note = f"{kind.replace('inplace', 'in place')} of %{groups.root[name]}" if kind else ""
        values.append(Row(name, plan.offsets[name], plan.nbytes(name), life.first, life.last, note))
    for node, (offset, nbytes) in plan.workspace.items():
        step = plan.order.index(node)
        values.append(Row(f"{node}.workspace", offset, nbytes, step, step, "workspace"))
    values.sort(key=lambda r: (r.first, r.offset))
    title = f"{flat.name} at B={plan.batch}"
    return ArenaView(
        title,
        buffers,
        values,
        plan.arena.arena_bytes,
        plan.arena.naive_bytes,
        plan.arena.lower_bound,
        len(plan.order) + 1,
        f"{plan.summary()} at B={plan.batch}",
    )


def _aligned(size: int, alignment: int) -> int:
    return -(-size // max(alignment, 1)) * max(alignment, 1)


def csv_view(path: Path, time_limit_s: float = 1.0) -> ArenaView:
    """Plan a MiniMalloc CSV at alignment 1, verify the plan, and view it."""
    from draftgraph.runtime.planning.arena_plan import plan_arena
    from draftgraph.runtime.planning.minimalloc_csv import capacity_from_name, load_minimalloc_csv
    from draftgraph.runtime.planning.verify_plan import verify_plan

    problem = load_minimalloc_csv(path)
    plan = plan_arena(problem, alignment=1, time_limit_s=time_limit_s)
    verify_plan(plan, problem)
    capacity = capacity_from_name(path)
    summary = plan.summary()
    if capacity is not None:
        verdict = "fits" if plan.arena_bytes <= capacity else "over"
        summary += f", capacity {capacity} B ({verdict})"
    rows = [Row(b.name, plan.offsets[b.name], b.size, b.start, b.end - 1) for b in plan.buffers]
    rows.sort(key=lambda r: (r.first, r.offset))
    return ArenaView(
        path.name,
        rows,
        rows,
        plan.arena_bytes,
        plan.naive_bytes,
        plan.lower_bound,
        max((b.end for b in plan.buffers), default=0),
        summary,
        capacity,
    )


# ---- output ----------------------------------------------------------------------------------


def format_table(view: ArenaView) -> str:
    """One row per value: name, offset, bytes, first..last step; then the summary line."""
    width = max([len("value")] + [len(r.name) for r in view.values])
    lines = [f"# {view.title}", f"{'value':<{width}}  {'offset':>10}  {'bytes':>10}  steps     note"]
    for r in view.values:
        steps = f"{r.first}..{r.last}"
        lines.append(f"{r.name:<{width}}  {r.offset:>#10x}  {r.nbytes:>10}  {steps:<8}  {r.note}".rstrip())
    lines.append(view.summary)
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from draftgraph.tools.arg_checks import (
        check_output_file,
        check_output_folder,
        check_seconds,
        lookup_errors,
        picture_format,
    )
    from draftgraph.tools.cli import UsageError

    if args.format == "png" and args.out is None:
        raise UsageError("--out: expected a picture file (.png or .svg) with --format png")
    check_seconds("--time-limit", args.time_limit)
    csv_folder = csv_found = False
    if args.csv is not None:
        with lookup_errors("--csv", "a MiniMalloc CSV file or folder", args.csv):
            csv_found = args.csv.exists()
            csv_folder = csv_found and args.csv.is_dir()
    if csv_folder and args.format == "png":
        check_output_folder("--out", args.out, what="a folder for the pictures (made if need be)", create=True)
    else:
        if args.format == "png":
            picture_format("--out", args.out)
        check_output_file("--out", args.out)
    if csv_folder:
        return _run_folder(args)
    if args.csv is not None:
        if not csv_found:
            raise UsageError(
                f"--csv: expected a MiniMalloc CSV file or folder, got {str(args.csv)!r} (not found)"
            )
        view = csv_view(args.csv, args.time_limit)
    else:
        from draftgraph.tools.chain_select import selected_chain

        view = chain_view(*selected_chain(args))
    _write(view, args.format, args.out)
    return 0


def _write(view: ArenaView, fmt: str, out: Path | None) -> None:
    if fmt == "text":
        text = format_table(view)
        if out is None:
            sys.stdout.write(text)
        else:
            out.write_text(text)
        return
    draw_arena(view, out)
    print(f"wrote {out}: {view.summary}", file=sys.stderr)


def _run_folder(args) -> int:
    from draftgraph.tools.cli import UsageError
    from tqdm import tqdm

    paths = sorted(args.csv.glob("*.csv"))
    if not paths:
        raise UsageError(f"--csv: expected *.csv files in {str(args.csv)!r}, found none")
    if args.format == "png":
        args.out.mkdir(parents=True, exist_ok=True)
    for path in tqdm(paths, desc="planning", unit="csv", file=sys.stderr):
        view = csv_view(path, args.time_limit)
        if args.format == "png":
            draw_arena(view, args.out / (path.stem + ".png"))
        else:
            tqdm.write(f"{path.name}: {view.summary}", file=sys.stdout)
    return 0


def _short_bytes(n: float) -> str:
    from draftgraph.runtime.planning.arena_plan import format_bytes_short

    return format_bytes_short(int(n)) + ("" if n >= 1024 else " B")


def draw_arena(view: ArenaView, out: Path, dpi: int = 110) -> None:
    """The plan as rectangles in (step, offset) space, with lower-bound and arena lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from draftgraph.tools.colors import family_color
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

    steps = max(view.num_steps, 1)
    top = max(view.arena_bytes, view.lower_bound, view.capacity or 0, 1)
    fig_w = min(max(10.0, 0.26 * steps + 2.5), 40.0)
    fig_h = min(max(6.0, 0.28 * len(view.buffers) ** 0.75 + 4.0), 24.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), layout="constrained", dpi=dpi)
    ax.set_xlim(0, steps)
    ax.set_ylim(0, top * 1.06)
    fig.canvas.draw()  # settles the constrained layout, so the axes' pixel size is final
    bbox = ax.get_window_extent()
    px_x, px_y = bbox.width / steps, bbox.height / (top * 1.06)
    for row in view.buffers:
        width, slot = row.last + 1 - row.first, max(row.footprint, row.nbytes)
        color = family_color(row.family or row.name)
        hatch = "///" if row.note == "workspace" else None
        if slot > row.nbytes:  # the alignment padding, pale
            ax.add_patch(
                Rectangle((row.first, row.offset), width, slot, facecolor=color, alpha=0.35, edgecolor="none")
            )
        ax.add_patch(
            Rectangle(
                (row.first, row.offset), width, row.nbytes, facecolor=color, edgecolor="none", hatch=hatch
            )
        )
        ax.add_patch(
            Rectangle(
                (row.first, row.offset), width, slot, facecolor="none", edgecolor="#333333", linewidth=0.6
            )
        )
        _label(ax, row, width * px_x, slot * px_y, dpi)
    ax.axhline(view.lower_bound, color="#c0392b", linestyle="--", linewidth=1.2)
    ax.axhline(view.arena_bytes, color="black", linewidth=1.4)
    ax.text(
        steps,
        view.arena_bytes,
        f" arena {_short_bytes(view.arena_bytes)}",
        va="bottom",
        ha="right",
        fontsize=9,
        fontweight="bold",
    )
    ax.text(
        steps * 0.005,
        view.lower_bound,
        f"lower bound {_short_bytes(view.lower_bound)} ",
        va="bottom",
        ha="left",
        fontsize=9,
        color="#c0392b",
    )
    if view.capacity is not None:
        ax.axhline(view.capacity, color="#2471a3", linestyle=":", linewidth=1.4)
        ax.text(
            steps / 2,
            view.capacity,
            f"capacity {_short_bytes(view.capacity)}",
            va="bottom",
            ha="center",
            fontsize=9,
            color="#2471a3",
        )
    optimal = " (optimal: meets the lower bound)" if view.arena_bytes == view.lower_bound else ""
    ax.set_title(
        f"{view.title}: arena {_short_bytes(view.arena_bytes)}{optimal}, "
        f"naive {_short_bytes(view.naive_bytes)}, lower bound {_short_bytes(view.lower_bound)}, "
        f"{len(view.buffers)} buffers",
        fontsize=11,
    )
    ax.set_xlabel("schedule step")
    ax.set_ylabel("byte offset")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MultipleLocator(2 ** max(0, round(math.log2(top / 8)))))  # round byte ticks
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short_bytes(v)))
    ax.grid(axis="x", color="#eeeeee", linewidth=0.5)
    ax.set_axisbelow(True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def _label(ax, row: Row, width_px: float, height_px: float, dpi: int) -> None:
    """The buffer's name inside its rectangle if it fits (flat, else upright; shortened
    by leading name components if need be), else nothing."""
    parts = row.name.split(".")
    candidates = [".".join(parts[i:]) for i in range(len(parts))]
    for name in candidates:
        for size in (8.0, 6.5, 5.5):
            text_w, text_h = len(name) * 0.6 * size * dpi / 72, 1.3 * size * dpi / 72
            for rotation, (w, h) in ((0, (text_w, text_h)), (90, (text_h, text_w))):
                if w <= width_px - 3 and h <= height_px - 1:
                    ax.text(
                        row.first + (row.last + 1 - row.first) / 2,
                        row.offset + max(row.footprint, row.nbytes) / 2,
                        name,
                        fontsize=size,
                        rotation=rotation,
                        ha="center",
                        va="center",
                        clip_on=True,
                    )
                    return
