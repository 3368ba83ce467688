"""Arena planning: give every intermediate buffer a byte offset inside one arena.

Two buffers may share bytes only when their lifetimes ``[start, end)`` are disjoint. The
planner is a pure function of the buffer list (and a seed): :func:`plan_arena` returns an
:class:`ArenaPlan`, and :func:`draftgraph.runtime.planning.verify_plan.verify_plan` checks one independently.

Design note "placement search"
    Finding the smallest arena is dynamic storage allocation, which is NP-hard; sizes are
    rounded up to ``alignment`` and the work happens in units of it. Plans are made in two
    steps. First, best-fit by decreasing size under a few orderings (size, duration, area,
    start) gives a plan in milliseconds, and when it meets the lower bound (max live bytes
    at any step; common for chains) we stop. Otherwise :mod:`draftgraph.runtime.planning.arena_search` runs
    MiniMalloc-style depth-first dives under a shrinking capacity (M. D. Moffitt,
    "MiniMalloc", ASPLOS 2023), with an iteration budget plus a wall-clock cap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from draftgraph.runtime.errors import PlanError, describe
from draftgraph.runtime.planning.arena_search import improve

DEFAULT_ALIGNMENT = 256
# The search keeps [buffers, buffers] and [buffers, steps] tables; past this many buffers
# (far beyond one draft-step graph) the greedy start is the plan.
MAX_SEARCH_BUFFERS = 1500
# Steps, sizes and their aligned total stay below 2**62: int64 offsets with headroom (as MAX_CSV_INT).
MAX_PLAN_INT = 2**62


@dataclass(frozen=True)
class Buffer:
    """One intermediate value to place: live over the schedule steps ``[start, end)``.

    Parameters
    ----------
    name : str
        Unique name (the value's name in the graph).
    start : int
        First schedule step at which the buffer is live (inclusive).
    end : int
        One past the last step at which it is live (exclusive); ``end > start``.
    size : int
        Bytes, ``> 0``.

    Examples
    --------
    >>> Buffer("h", start=0, end=3, size=4096)
    Buffer(name='h', start=0, end=3, size=4096)
    """

    name: str
    start: int
    end: int
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise PlanError(describe("buffer name", "a str", repr(self.name)))
        for field in ("start", "end", "size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PlanError(describe(f"buffer {self.name!r} {field}", "an int", repr(value)))
            if not -MAX_PLAN_INT < value < MAX_PLAN_INT:
                raise PlanError(describe(f"buffer {self.name!r} {field}", "a magnitude below 2**62", value,
                                         "offsets are int64 arrays with headroom"))
        if self.start < 0:
            raise PlanError(describe(f"buffer {self.name!r} start", "a schedule step >= 0", self.start))
        if self.size <= 0:
            raise PlanError(describe(f"buffer {self.name!r} size", "> 0 bytes", self.size))
        if self.end <= self.start:
            raise PlanError(
                describe(
                    f"buffer {self.name!r} lifetime",
                    "end > start (live over [start, end))",
                    f"[{self.start}, {self.end})",
                    "a value used only at step s lives over [s, s + 1)",
                )
            )


@dataclass(frozen=True)
class ArenaPlan:
    """Byte offsets for a set of buffers inside one arena of ``arena_bytes``.

    Attributes
    ----------
    offsets : dict[str, int]
        Byte offset of each buffer, a multiple of ``alignment``.
    buffers : tuple[Buffer, ...]
        The buffers that were planned.
    arena_bytes : int
        ``max(offset + aligned size)``: the arena to allocate.
    naive_bytes : int
        Sum of aligned sizes: the arena without any reuse.
    lower_bound : int
        Max over steps of the live aligned bytes: no plan can be smaller.
    alignment : int
        Every offset is a multiple of it and every size is rounded up to it.
    strategy : str
        Which ordering or search produced the plan, e.g. ``"best-fit/size+search"``.
    planning_seconds : float
        Wall time spent planning.

    Examples
    --------
    >>> plan = plan_arena([Buffer("a", 0, 2, 1000), Buffer("b", 2, 4, 1000)])
    >>> plan.summary()
    'arena 1.0 KB (naive 2.0 KB, lower bound 1.0 KB), 2 values'
    """

    offsets: dict[str, int]
    buffers: tuple[Buffer, ...]
    arena_bytes: int
    naive_bytes: int
    lower_bound: int
    alignment: int
    strategy: str
    planning_seconds: float

    def summary(self) -> str:
        """One line: ``arena 1.2 MB (naive 4.8 MB, lower bound 1.2 MB), 61 values``."""
        return (
            f"arena {format_bytes(self.arena_bytes)} (naive {format_bytes(self.naive_bytes)}, "
            f"lower bound {format_bytes(self.lower_bound)}), {len(self.buffers)} values"
        )

    def to_json(self) -> dict:
        """A JSON-ready dict; :meth:`from_json` reads it back."""
        return {
            "alignment": self.alignment,
            "arena_bytes": self.arena_bytes,
            "naive_bytes": self.naive_bytes,
            "lower_bound": self.lower_bound,
            "strategy": self.strategy,
            "planning_seconds": self.planning_seconds,
            "buffers": [
                dict(name=b.name, start=b.start, end=b.end, size=b.size, offset=self.offsets[b.name])
                for b in self.buffers
            ],
        }

    @staticmethod
    def from_json(d: dict) -> ArenaPlan:
        """Rebuild a plan written by :meth:`to_json`."""
        try:
            rows = d["buffers"]
            buffers = tuple(Buffer(r["name"], int(r["start"]), int(r["end"]), int(r["size"])) for r in rows)
            return ArenaPlan(
                offsets={r["name"]: int(r["offset"]) for r in rows},
                buffers=buffers,
                arena_bytes=int(d["arena_bytes"]),
                naive_bytes=int(d["naive_bytes"]),
                lower_bound=int(d["lower_bound"]),
                alignment=int(d["alignment"]),
                strategy=str(d["strategy"]),
                planning_seconds=float(d["planning_seconds"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            expected = "the dict ArenaPlan.to_json writes"
            raise PlanError(describe("arena plan JSON", expected, repr(err))) from err


def aligned(size: int, alignment: int) -> int:
    """``size`` rounded up to a multiple of ``alignment`` (the buffer's footprint)."""
    return -(-size // alignment) * alignment


def lower_bound(buffers: Sequence[Buffer], alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Max over schedule steps of the aligned bytes live at that step.

    Every plan needs at least this much, so a plan that reaches it is optimal.

    Examples
    --------
    >>> lower_bound([Buffer("a", 0, 2, 100), Buffer("b", 1, 3, 100)], alignment=1)
    200
    """
    if not buffers:
        return 0
    # Sweep over start/end events; at equal steps ends come first (half-open lifetimes).
    events = sorted(
        [(b.start, 1, aligned(b.size, alignment)) for b in buffers]
        + [(b.end, 0, -aligned(b.size, alignment)) for b in buffers]
    )
    live = peak = 0
    for _, _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


_UNITS = ("B", "KB", "MB", "GB", "TB")


def _scaled(n: int) -> tuple[float, int]:
    """``n`` divided by 1024 until below 1024 (or out of units), and how many times."""
    value, power = float(n), 0
    while abs(value) >= 1024 and power < len(_UNITS) - 1:
        value, power = value / 1024, power + 1
    return value, power


def format_bytes(n: int) -> str:
    """Human-readable size in binary multiples: ``"512 B"``, ``"128.0 KB"``, ``"1.2 MB"``."""
    value, power = _scaled(n)
    return f"{n} B" if power == 0 else f"{value:.1f} {_UNITS[power]}"


def format_bytes_short(n: int) -> str:
    """Compact size for per-line comments: ``"640"``, ``"128K"``, ``"1.5K"``, ``"2M"``."""
    value, power = _scaled(n)
    if power == 0:
        return str(n)
    text = f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.1f}"
    return text.removesuffix(".0") + _UNITS[power][0]


def _check_input(buffers: tuple, alignment: int, time_limit_s: float, seed: int, max_attempts: int) -> None:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment < MAX_PLAN_INT:
        raise PlanError(describe("alignment", "a positive int below 2**62", repr(alignment)))
    if not isinstance(time_limit_s, (int, float)) or isinstance(time_limit_s, bool) or not 0 <= time_limit_s < math.inf:
        raise PlanError(describe("time_limit_s", "a finite number of seconds >= 0", repr(time_limit_s)))
    for what, value in (("seed", seed), ("max_attempts", max_attempts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(describe(what, "an int >= 0", repr(value)))
    seen: set[str] = set()
    total = 0
    for b in buffers:
        if not isinstance(b, Buffer):
            raise PlanError(describe("plan_arena input", "Buffer objects", type(b).__name__))
        if b.name in seen:
            raise PlanError(describe("buffer names", "unique names", f"{b.name!r} twice"))
        seen.add(b.name)
        total += aligned(b.size, alignment)
    if total >= MAX_PLAN_INT:
        raise PlanError(describe("buffer sizes", "an aligned total below 2**62 bytes", total))


def best_fit(order: Sequence[int], sizes: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Place buffers in ``order``, each into the tightest gap left by placed live neighbours.

    Gaps are the holes between the byte ranges of already placed buffers whose lifetimes
    overlap this one, plus the open space above them; the smallest gap that fits wins and
    the lowest such gap breaks ties. Returns offsets in the units of ``sizes``.
    """
    offsets = np.full(len(sizes), -1, dtype=np.int64)
    placed = np.zeros(len(sizes), dtype=bool)
    never = np.iinfo(np.int64).max
    for i in order:
        neighbours = placed & (start < end[i]) & (start[i] < end)
        if neighbours.any():
            lows = offsets[neighbours]
            by_low = np.argsort(lows, kind="stable")
            lows = lows[by_low]
            reach = np.maximum.accumulate(lows + sizes[neighbours][by_low])
            gap_start = np.concatenate(([0], reach))
            gap_len = np.concatenate((lows, [never])) - gap_start
            offsets[i] = gap_start[int(np.argmin(np.where(gap_len >= sizes[i], gap_len, never)))]
        else:
            offsets[i] = 0
        placed[i] = True
    return offsets


def _greedy_start(
    start: np.ndarray, end: np.ndarray, units: np.ndarray, bound: int
) -> tuple[np.ndarray, str]:
    """The lowest best-fit plan over a few orderings, stopping at the first that meets ``bound``."""
    duration = end - start
    orderings = {
        "size": np.lexsort((start, -duration, -units)),
        "duration": np.lexsort((start, -units, -duration)),
        "area": np.lexsort((start, -units, -units * duration)),
        "start": np.lexsort((-units, start)),
    }
    best, best_height, best_name = None, math.inf, ""
    for name, order in orderings.items():
        offsets = best_fit(order, units, start, end)
        height = int((offsets + units).max())
        if height < best_height:
            best, best_height, best_name = offsets, height, name
        if height <= bound:
            break
    return best, f"best-fit/{best_name}"


def plan_arena(
    buffers: Sequence[Buffer],
    alignment: int = DEFAULT_ALIGNMENT,
    time_limit_s: float = 1.0,
    seed: int = 0,
    *,
    max_attempts: int = 200,
) -> ArenaPlan:
    """Assign each buffer a byte offset so that buffers live at a common step never share bytes.

    Parameters
    ----------
    buffers : Sequence[Buffer]
        The buffers to place; names must be unique.
    alignment : int
        Offsets are multiples of it; sizes are rounded up to it for placement.
    time_limit_s : float
        Wall-clock cap on the improving search (the greedy start always runs).
    seed : int
        Seeds the search's perturbations: the same input and seed give the same plan as
        long as the search ends by ``max_attempts`` or by reaching the bound, not the clock.
    max_attempts : int
        Iteration budget: the most search dives to run after the greedy start. The search
        runs only when the greedy start misses the bound and there are at most
        ``MAX_SEARCH_BUFFERS`` buffers.

    Returns
    -------
    ArenaPlan
        The smallest plan found; planning stops early at the lower bound.

    Examples
    --------
    >>> plan = plan_arena([Buffer("x", 0, 2, 512), Buffer("y", 1, 3, 256), Buffer("z", 2, 4, 512)])
    >>> plan.arena_bytes, plan.lower_bound
    (768, 768)
    """
    began = time.perf_counter()
    try:
        buffers = tuple(buffers)  # once: an iterator would be spent by the checks
    except TypeError:
        raise PlanError(describe("plan_arena input", "a sequence of Buffer objects", type(buffers).__name__)) from None
    _check_input(buffers, alignment, time_limit_s, seed, max_attempts)
    units = np.array([aligned(b.size, alignment) // alignment for b in buffers], dtype=np.int64)
    bound_units = lower_bound(buffers, alignment) // alignment
    offsets, strategy = np.zeros(len(buffers), dtype=np.int64), "empty"
    if buffers:
        start = np.array([b.start for b in buffers], dtype=np.int64)
        end = np.array([b.end for b in buffers], dtype=np.int64)
        offsets, strategy = _greedy_start(start, end, units, bound_units)
        if int((offsets + units).max()) > bound_units and len(buffers) <= MAX_SEARCH_BUFFERS:
            deadline = began + time_limit_s
            improved = improve(start, end, units, offsets, bound_units, deadline, max_attempts, seed)
            if improved is not None:
                offsets, strategy = improved, strategy + "+search"
    offsets_bytes = {b.name: int(o) * alignment for b, o in zip(buffers, offsets)}
    return ArenaPlan(
        offsets=offsets_bytes,
        buffers=buffers,
        arena_bytes=int((offsets + units).max()) * alignment if buffers else 0,
        naive_bytes=int(units.sum()) * alignment,
        lower_bound=int(bound_units) * alignment,
        alignment=alignment,
        strategy=strategy,
        planning_seconds=time.perf_counter() - began,
    )
