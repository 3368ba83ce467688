"""verify_plan(): an independent check that an arena plan is safe to execute.

Written apart from the planner on purpose: it shares no code with
:mod:`draftgraph.runtime.planning.arena_plan` or :mod:`draftgraph.runtime.planning.arena_search` beyond the plain
data classes, and
re-derives which buffers are live together with a simple sweep over start times, so a bug
in the planner's own bookkeeping cannot hide itself here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from draftgraph.runtime.errors import PlanError, describe
from draftgraph.runtime.planning.arena_plan import ArenaPlan, Buffer


def _footprint(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _where(buffer: Buffer, offset: int, alignment: int) -> str:
    end = offset + _footprint(buffer.size, alignment)
    return f"{buffer.name!r} live [{buffer.start}, {buffer.end}) at bytes [{offset:#x}, {end:#x})"


def verify_plan(
    plan: ArenaPlan,
    buffers: Sequence[Buffer] | None = None,
    allowed_overlaps: Iterable[tuple[str, str]] = (),
) -> None:
    """Raise :class:`PlanError` unless ``plan`` places ``buffers`` safely.

    Checks that every buffer has an offset, every offset is ``>= 0`` and a multiple of
    ``plan.alignment``, every footprint (size rounded up to the alignment) ends inside
    ``plan.arena_bytes``, and no two buffers whose lifetimes overlap share a byte unless
    the pair is listed in ``allowed_overlaps`` (declared aliases, in either order).

    Parameters
    ----------
    plan : ArenaPlan
        The plan to check.
    buffers : Sequence[Buffer], optional
        The buffers to check against (e.g. lifetimes re-derived by the caller);
        ``plan.buffers`` when omitted.
    allowed_overlaps : Iterable[tuple[str, str]]
        Pairs of names that may share bytes while both are live.

    Raises
    ------
    PlanError
        Naming the offending buffer(s), their lifetimes and byte ranges.

    Examples
    --------
    >>> from draftgraph.runtime.planning.arena_plan import Buffer, plan_arena
    >>> buffers = [Buffer("a", 0, 2, 64), Buffer("b", 1, 3, 64)]
    >>> verify_plan(plan_arena(buffers, alignment=64))
    """
    buffers = plan.buffers if buffers is None else tuple(buffers)
    alignment = plan.alignment
    if alignment <= 0:
        raise PlanError(describe("plan alignment", "a positive number of bytes", alignment))
    allowed = {frozenset(pair) for pair in allowed_overlaps}

    names = set()
    for b in buffers:
        if b.name in names:
            raise PlanError(describe("buffer names", "unique names", f"{b.name!r} twice"))
        names.add(b.name)
        if b.name not in plan.offsets:
            raise PlanError(
                describe(
                    f"offset of buffer {b.name!r}",
                    "an offset in the plan",
                    "none",
                    "re-plan after adding the buffer",
                )
            )
        offset = plan.offsets[b.name]
        if offset < 0:
            raise PlanError(describe(f"offset of {_where(b, offset, alignment)}", ">= 0", offset))
        if offset % alignment:
            raise PlanError(
                describe(f"offset of {_where(b, offset, alignment)}", f"a multiple of {alignment}", offset)
            )
        if offset + _footprint(b.size, alignment) > plan.arena_bytes:
            raise PlanError(
                describe(
                    f"end of {_where(b, offset, alignment)}",
                    f"<= arena_bytes {plan.arena_bytes:#x}",
                    f"{offset + _footprint(b.size, alignment):#x}",
                )
            )

    # Sweep by start step. `live` holds the buffers whose lifetime reaches the current
    # start; lifetimes are half-open, so one ending at step s is gone when another starts at s.
    live: list[Buffer] = []
    for b in sorted(buffers, key=lambda x: (x.start, x.end, x.name)):
        live = [other for other in live if other.end > b.start]
        low = plan.offsets[b.name]
        high = low + _footprint(b.size, alignment)
        for other in live:
            other_low = plan.offsets[other.name]
            other_high = other_low + _footprint(other.size, alignment)
            if low < other_high and other_low < high and frozenset((b.name, other.name)) not in allowed:
                raise PlanError(
                    describe(
                        "bytes of buffers live at the same step",
                        "disjoint byte ranges",
                        f"{_where(other, other_low, alignment)} and {_where(b, low, alignment)} overlapping",
                        "a planner bug, or a missing allowed_overlaps pair for a declared alias",
                    )
                )
        live.append(b)
