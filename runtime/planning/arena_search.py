"""The improving search behind :func:`draftgraph.runtime.planning.arena_plan.plan_arena`.

Design note "dives"
    A dive asks: do the buffers fit under capacity ``C``? It is the depth-first search of
    MiniMalloc (M. D. Moffitt, "MiniMalloc: A Lightweight Memory Allocator for
    Hardware-Accelerated Machine Learning", ASPLOS 2023), re-implemented over numpy:

    * canonical solutions only: every buffer sits at its *minimum offset* (the highest top
      of the placed buffers it overlaps in time) and buffers are placed in non-decreasing
      offset order, ties broken by a static preorder (the "WAT", "TAW" and "TWA" keys:
      sections spanned, area, max section total);
    * dominance: never place a buffer at or above the top another unplaced buffer could
      reach, that would leave a hole it fits in;
    * section inference: in each time section, the bytes still to place must fit between
      the section's floor (its skyline, raised to the lowest minimum offset of the unplaced
      buffers there, and to the current offset since offsets only grow) and ``C``;
    * dynamic decomposition: once the unplaced buffers fall into groups that share no
      time section, each group is solved on its own, so a failure in one never makes the
      search thrash through the decisions of another.

    A dive that exhausts its tree proves ``C`` infeasible; one that runs out of its node
    budget says nothing. The search is heavy-tailed (a dive either succeeds within about
    ``n`` nodes or wanders), so :func:`improve` runs many short dives: first one per
    preorder, then perturbations (a few adjacent swaps) of the preorder that last
    succeeded, under a capacity that shrinks after each success and relaxes after each
    failure. Each success lowers the best height; each proof raises the lower bound.
"""

from __future__ import annotations

import sys
import time

import numpy as np

_UNSET = np.iinfo(np.int64).max
_CHECK_CLOCK_EVERY = 32  # nodes between wall-clock checks


class _OutOfBudget(Exception):
    """A dive used its node budget or passed the deadline."""


class _Problem:
    """Buffers over compressed time: section k is the k-th gap between distinct start/end steps."""

    def __init__(self, start: np.ndarray, end: np.ndarray, sizes: np.ndarray) -> None:
        steps = np.unique(np.concatenate([start, end]))
        self.first = np.searchsorted(steps, start)  # first section of each buffer
        self.stop = np.searchsorted(steps, end)  # one past its last section
        self.sizes = sizes
        self.num_sections = len(steps) - 1
        sections = np.arange(self.num_sections)
        self.covers = (self.first[:, None] <= sections) & (sections < self.stop[:, None])  # [n, T]
        self.total = (self.covers * sizes[:, None]).sum(axis=0)  # bytes live per section
        self.conflict = (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])  # [n, n]
        np.fill_diagonal(self.conflict, False)  # live at a common step

    def preorders(self, area: np.ndarray) -> list[np.ndarray]:
        width = self.stop - self.first
        peak_total = np.where(self.covers, self.total, 0).max(axis=1)
        return [
            np.lexsort((-peak_total, -area, -width)),  # WAT
            np.lexsort((-width, -area, -peak_total)),  # TAW
            np.lexsort((-area, -width, -peak_total)),  # TWA
        ]

    def split(self, group: np.ndarray) -> list[np.ndarray]:
        """Split buffers into groups that share no section (sorted by first section)."""
        if len(group) <= 1:
            return [group]
        by_first = group[np.argsort(self.first[group], kind="stable")]
        reach = np.maximum.accumulate(self.stop[by_first])
        cuts = np.nonzero(self.first[by_first][1:] >= reach[:-1])[0] + 1
        return np.split(by_first, cuts) if len(cuts) else [group]


class _Dive:
    """One depth-first search for a placement under ``capacity``; see the module note."""

    def __init__(
        self, problem: _Problem, capacity: int, preorder: np.ndarray, max_nodes: int, deadline: float
    ) -> None:
        n = len(problem.sizes)
        self.p, self.capacity, self.max_nodes, self.deadline = problem, capacity, max_nodes, deadline
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[preorder] = np.arange(n)
        self.min_offset = np.zeros(n, dtype=np.int64)
        self.offset = np.full(n, -1, dtype=np.int64)
        self.unplaced = np.ones(n, dtype=bool)
        self.skyline = np.zeros(problem.num_sections, dtype=np.int64)
        self.remaining = problem.total.copy()
        self.nodes = 0

    def run(self) -> np.ndarray | bool | None:
        """Offsets if it fits, False if proven not to, None if out of budget."""
        try:
            groups = self.p.split(np.arange(len(self.p.sizes)))
            return self.offset.copy() if self._search_each(groups) else False
        except _OutOfBudget:
            return None

    def _search_each(self, groups: list[np.ndarray]) -> bool:
        # A plain loop, not all(generator): plain Python calls nest without using the C stack.
        for group in groups:
            if not self._search(group, 0, -1):
                return False
        return True

    def _search(self, group: np.ndarray, last_offset: int, last_rank: int) -> bool:
        if len(group) == 0:
            return True
        p, capacity = self.p, self.capacity
        lo, hi = int(p.first[group].min()), int(p.stop[group].max())
        min_offset = self.min_offset[group]
        lowest_start = np.where(p.covers[group, lo:hi], min_offset[:, None], _UNSET).min(axis=0)
        floor = np.maximum(np.maximum(self.skyline[lo:hi], last_offset), lowest_start)
        remaining = self.remaining[lo:hi]
        if ((floor + remaining) > capacity).any():
            return False
        sizes, rank = p.sizes[group], self.rank[group]
        eligible = (
            (min_offset < (min_offset + sizes).min())  # dominance
            & (min_offset <= capacity - remaining.max())  # what is left must fit above it
            & (min_offset + sizes <= capacity)
            & ((min_offset > last_offset) | ((min_offset == last_offset) & (rank > last_rank)))
        )
        candidates = group[eligible][np.lexsort((rank[eligible], min_offset[eligible]))]
        for i in candidates.tolist():
            if self._try(group, i):
                return True
        return False

    def _try(self, group: np.ndarray, i: int) -> bool:
        self.nodes += 1  # one node per placement tried: a dive that never backtracks uses n
        if self.nodes > self.max_nodes or (
            self.nodes % _CHECK_CLOCK_EVERY == 0 and time.perf_counter() > self.deadline
        ):
            raise _OutOfBudget
        p = self.p
        first, stop = p.first[i], p.stop[i]
        low = int(self.min_offset[i])
        top = low + int(p.sizes[i])
        saved_skyline = self.skyline[first:stop].copy()
        self.skyline[first:stop] = top
        self.remaining[first:stop] -= p.sizes[i]
        self.unplaced[i], self.offset[i] = False, low
        raised = np.nonzero(p.conflict[i] & self.unplaced)[0]
        saved_min = self.min_offset[raised].copy()
        self.min_offset[raised] = np.maximum(saved_min, top)
        rest = group[group != i]
        parts = p.split(rest)
        if len(parts) == 1:
            if self._search(rest, low, int(self.rank[i])):
                return True
        else:
            state = (
                self.skyline.copy(),
                self.remaining.copy(),
                self.min_offset.copy(),
                self.offset.copy(),
                self.unplaced.copy(),
            )
            if self._search_each(parts):
                return True
            self.skyline[:], self.remaining[:], self.min_offset[:], self.offset[:], self.unplaced[:] = state
        self.min_offset[raised] = saved_min
        self.unplaced[i], self.offset[i] = True, -1
        self.remaining[first:stop] += p.sizes[i]
        self.skyline[first:stop] = saved_skyline
        return False


def improve(
    start: np.ndarray,
    end: np.ndarray,
    sizes: np.ndarray,
    offsets: np.ndarray,
    bound: int,
    deadline: float,
    max_attempts: int,
    seed: int,
) -> np.ndarray | None:
    """Search for a lower placement than ``offsets`` (in the units of ``sizes``).

    Returns better offsets, or None when no dive beat the start. Stops at ``bound``, when a
    dive proves nothing lower fits, after ``max_attempts`` dives, or at ``deadline``.
    """
    n = len(sizes)
    problem = _Problem(start, end, sizes)
    preorders = problem.preorders(sizes * (end - start))
    rng = np.random.default_rng(seed)
    best, proven = int((offsets + sizes).max()), bound
    improved: np.ndarray | None = None
    followed: np.ndarray | None = None
    step = 0.5  # fraction of the gap to the lower bound that the next dive tries to close
    max_nodes = max(2 * n, 500)
    jitter = max(0.5, 0.003 * n)  # std of the rank noise: a few adjacent swaps
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * n + 1000))  # a dive recurses once per placed buffer
    try:
        for attempt in range(max_attempts):
            if best <= proven or time.perf_counter() > deadline:
                break
            capacity = best - max(1, int((best - proven) * step))
            if attempt < len(preorders):
                preorder = preorders[attempt]
            else:
                base = followed if followed is not None and rng.random() < 0.7 else preorders[attempt % 3]
                rank = np.empty(n)
                rank[base] = np.arange(n)
                preorder = np.argsort(rank + rng.normal(0.0, jitter, n), kind="stable")
            found = _Dive(problem, capacity, preorder, max_nodes, deadline).run()
            if found is None:
                step = max(0.005, step * 0.7)
            elif found is False:
                proven = capacity + 1
            else:
                improved, followed = found, preorder
                best = int((found + sizes).max())
                step = min(0.5, step * 2)
    finally:
        sys.setrecursionlimit(limit)
    return improved
