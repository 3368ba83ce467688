"""Read and write the MiniMalloc CSV format (google/minimalloc).

One row per buffer, ``id,lower,upper,size``: the buffer is live over the half-open interval
``[lower, upper)`` and needs ``size`` bytes. A solution file adds an ``offset`` column. Ids
are strings (``b1``, ``17``). Benchmark files carry their capacity in the name, e.g.
``A.1048576.csv``. The instances are planned at alignment 1.

Examples
--------
>>> buffers = parse_minimalloc_csv("id,lower,upper,size\\nb1,0,3,4\\nb2,3,9,4\\n").buffers
>>> buffers[1]
Buffer(name='b2', start=3, end=9, size=4)
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftgraph.runtime.errors import PlanError, describe
from draftgraph.runtime.planning.arena_plan import MAX_PLAN_INT, Buffer

# Column name -> accepted spellings (older MiniMalloc files say "buffer" for "id").
_COLUMNS = {"id": ("id", "buffer"), "lower": ("lower",), "upper": ("upper",), "size": ("size",)}
_OPTIONAL = ("offset",)
_CAPACITY_IN_NAME = re.compile(r"\.(\d+)\.csv$")
# The planner works in int64: steps, sizes and their total (the naive arena, which bounds every
# offset + size) must stay below 2**62 to leave it headroom. Far beyond any real arena (4 EiB).
MAX_CSV_INT = MAX_PLAN_INT


@dataclass(frozen=True)
class MiniMallocCsv:
    """A parsed file: its buffers, and the offsets when the file is a solution."""

    buffers: tuple[Buffer, ...]
    offsets: dict[str, int] | None = None


def parse_minimalloc_csv(text: str, source: str = "<csv>") -> MiniMallocCsv:
    """Parse MiniMalloc CSV text; ``source`` names it in errors (``file:line``).

    Raises
    ------
    PlanError
        On a missing or unknown column, no buffer rows, a non-integer field, a number of
        ``MAX_CSV_INT`` or more (sizes: in total), ``upper <= lower``, a size that is not
        positive, or a repeated id; the message names the line.
    """
    rows = list(csv.reader(io.StringIO(text)))
    rows = [(number, row) for number, row in enumerate(rows, start=1) if any(cell.strip() for cell in row)]
    if not rows:
        raise PlanError(describe(f"{source}", "a header line 'id,lower,upper,size'", "an empty file"))
    header = [cell.strip().lower() for cell in rows[0][1]]
    position = {}
    for column, spellings in _COLUMNS.items():
        found = [header.index(s) for s in spellings if s in header]
        if not found:
            raise PlanError(describe(f"{source}:1 header", "columns id,lower,upper,size", ",".join(header)))
        position[column] = found[0]
    if "offset" in header:
        position["offset"] = header.index("offset")
    known = {s for spellings in _COLUMNS.values() for s in spellings} | set(_OPTIONAL)
    unknown = [cell for cell in header if cell not in known]
    if unknown:
        raise PlanError(
            describe(
                f"{source}:1 header",
                "only id,lower,upper,size[,offset]",
                f"column {unknown[0]!r}",
                "per-buffer alignment and gaps are not supported",
            )
        )

    buffers: list[Buffer] = []
    offsets: dict[str, int] = {}
    seen: set[str] = set()
    total_bytes = 0
    for number, row in rows[1:]:
        where = f"{source}:{number}"
        if len(row) != len(header):
            raise PlanError(describe(f"{where}", f"{len(header)} fields", f"{len(row)}: {','.join(row)!r}"))
        name = row[position["id"]].strip()
        values = {}
        for column in ("lower", "upper", "size", "offset"):
            if column in position:
                cell = row[position[column]].strip()
                try:
                    values[column] = int(cell)
                except ValueError:
                    raise PlanError(describe(f"{where} {column}", "an integer", repr(cell))) from None
                if abs(values[column]) >= MAX_CSV_INT:
                    raise PlanError(
                        describe(f"{where} {column}", f"an integer of magnitude below 2**62 ({MAX_CSV_INT})", cell)
                    )
        if name in seen:
            raise PlanError(describe(f"{where} id", "unique ids", f"{name!r} again"))
        if values["upper"] <= values["lower"]:
            raise PlanError(
                describe(
                    f"{where} buffer {name!r}",
                    "upper > lower (live over [lower, upper))",
                    f"lower={values['lower']}, upper={values['upper']}",
                )
            )
        if values["size"] <= 0:
            raise PlanError(describe(f"{where} buffer {name!r} size", "a positive size", values["size"]))
        seen.add(name)
        buffers.append(Buffer(name, values["lower"], values["upper"], values["size"]))
        total_bytes += values["size"]
        if total_bytes >= MAX_CSV_INT:
            raise PlanError(
                describe(f"{where} sizes", f"a total below 2**62 ({MAX_CSV_INT}) bytes", f"{total_bytes} so far")
            )
        if "offset" in values:
            offsets[name] = values["offset"]
    if not buffers:
        raise PlanError(
            describe(f"{source}", "at least one buffer row after the header", "the header only", "one row per buffer")
        )
    return MiniMallocCsv(tuple(buffers), offsets if "offset" in position else None)


# 64 MiB: about two million buffer rows, far past what the planner is for (the benchmarks' largest
# file is 11 KB); it bounds what a device or an endless pipe given as the file would make us read.
MAX_CSV_BYTES = 64 << 20


def read_minimalloc_csv(path: str | Path) -> MiniMallocCsv:
    """Read a MiniMalloc CSV file (problem or solution); raises OSError (FileNotFoundError: none
    there) or PlanError (past MAX_CSV_BYTES, bytes that are not UTF-8 text, rows that do not parse)."""
    path = Path(path)
    with path.open("rb") as file:  # bounded: a device or an endless pipe (/dev/zero) is refused, not read
        data = file.read(MAX_CSV_BYTES + 1)
    if len(data) > MAX_CSV_BYTES:
        raise PlanError(describe(path.name, f"a MiniMalloc CSV file of at most {MAX_CSV_BYTES} bytes",
                                 "more (a device or an endless stream?)", "give it a CSV file"))
    try:
        text = data.decode()
    except UnicodeDecodeError as err:  # a binary file, a Latin-1 export: one typed line, not a traceback
        raise PlanError(describe(path.name, "a UTF-8 MiniMalloc CSV file", f"{err.reason} at byte {err.start}",
                                 "save it as UTF-8 text")) from None
    return parse_minimalloc_csv(text, source=path.name)


def load_minimalloc_csv(path: str | Path) -> list[Buffer]:
    """The buffers of a MiniMalloc CSV file, ready for ``plan_arena(..., alignment=1)``."""
    return list(read_minimalloc_csv(path).buffers)


def format_minimalloc_csv(buffers: Sequence[Buffer], offsets: Mapping[str, int] | None = None) -> str:
    """MiniMalloc CSV text for ``buffers``; with ``offsets``, a solution (extra ``offset`` column)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["id", "lower", "upper", "size"] + (["offset"] if offsets is not None else []))
    for b in buffers:
        writer.writerow([b.name, b.start, b.end, b.size] + ([offsets[b.name]] if offsets is not None else []))
    return out.getvalue()


def save_minimalloc_csv(
    path: str | Path, buffers: Sequence[Buffer], offsets: Mapping[str, int] | None = None
) -> None:
    """Write :func:`format_minimalloc_csv` output to ``path``."""
    Path(path).write_text(format_minimalloc_csv(buffers, offsets))


def capacity_from_name(path: str | Path) -> int | None:
    """The capacity in a benchmark file name like ``A.1048576.csv``, else None."""
    match = _CAPACITY_IN_NAME.search(Path(path).name)
    return int(match.group(1)) if match else None
