"""Chrome-trace / Perfetto JSON of graph runs: one slice per op, nested under its scope.

On CPU each op is timed with host timers; on CUDA with CUDA events recorded
around it (read after the run, so timing does not add syncs inside it). Ops of
a subgraph (the body) are nested under a slice named after their scope, e.g.
``d0.body``; a subgraph inside a subgraph nests one level deeper. A scope slice
never spans two runs: it is cut wherever a free-standing slice (a whole
propose, a captured replay) begins or ends. A captured replay is one launch, so
it appears as one slice. Open the file in https://ui.perfetto.dev or chrome://tracing.

Example
-------
>>> tracer = Tracer()
>>> executor.tracer = tracer          # doctest: +SKIP
>>> executor.run(inputs)              # doctest: +SKIP
>>> tracer.save("trace.json")         # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import time

import torch


class Tracer:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self._spans: list[tuple[int, int]] = []  # (start_ns, end_ns) of each event, exact
        self._open: list[tuple] = []
        self._cuda: list[tuple] = []
        self._origin = time.perf_counter_ns()

    # ---- executor hooks --------------------------------------------------------------------
    def begin(self, node) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open.append((node, start, time.perf_counter_ns()))
        else:
            self._open.append((node, None, time.perf_counter_ns()))

    def end(self, node) -> None:
        opened, start, host_start = self._open.pop()
        if start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._cuda.append((opened, start, stop, host_start))
        else:
            self._add(opened, host_start, time.perf_counter_ns() - host_start)

    def slice(
        self, name: str, start_ns: int, dur_ns: int, cat: str = "run", args: dict | None = None
    ) -> None:
        """A free-standing slice (a whole propose, a captured replay)."""
        self._append({"name": name, "cat": cat, "args": args or {}}, start_ns, dur_ns)

    def _add(self, node, start_ns: int, dur_ns: int) -> None:
        self._append(
            {"name": node.name, "cat": node.op, "args": {"op": node.op, "scope": node.scope}},
            start_ns,
            dur_ns,
        )

    def _append(self, event: dict, start_ns: int, dur_ns: int) -> None:
        start = start_ns - self._origin
        event.update({"ph": "X", "pid": os.getpid(), "tid": 0, "ts": start / 1e3, "dur": dur_ns / 1e3})
        self.events.append(event)
        self._spans.append((start, start + dur_ns))

    def _resolve_cuda(self) -> None:
        if not self._cuda:
            return
        torch.cuda.synchronize()
        first_host, first_event = self._cuda[0][3], self._cuda[0][1]
        for node, start, stop, _ in self._cuda:
            offset_ms = first_event.elapsed_time(start)
            self._add(node, first_host + int(offset_ms * 1e6), int(start.elapsed_time(stop) * 1e6))
        self._cuda.clear()

    # ---- attaching -----------------------------------------------------------------------------
    def attach(self, proposer) -> None:
        proposer.tracer = self
        for executor in proposer._executors.values():
            executor.tracer = self

    def detach(self, proposer) -> None:
        proposer.tracer = None
        for executor in proposer._executors.values():
            executor.tracer = None

    # ---- output ----------------------------------------------------------------------------------
    def scope_slices(self) -> list[dict]:
        """One enclosing slice per run of consecutive ops sharing a scope (nesting for the viewer).

        A scope ``a.b`` nests inside ``a`` when ``a`` is itself the scope of some op.
        """
        ops = sorted(
            (i for i, e in enumerate(self.events) if e["cat"] not in ("run", "scope")),
            key=lambda i: self._spans[i],
        )
        known = {self.events[i]["args"].get("scope") for i in ops} - {None, ""}
        cuts = sorted({t for i, e in enumerate(self.events) if e["cat"] == "run" for t in self._spans[i]})
        out: list[dict] = []
        depth = max((s.count(".") + 1 for s in known), default=0)
        for level in range(1, depth + 1):
            run: list[int] = []
            for i in ops + [None]:
                scope = (
                    self._level(self.events[i]["args"].get("scope") or "", level, known)
                    if i is not None
                    else None
                )
                if run and (scope != run[0][1] or self._cut_between(run[-1][0], i, cuts)):
                    out.append(self._enclosing(run[0][1], run[0][0], run[-1][0]))
                    run = []
                if i is not None and scope:
                    run.append((i, scope))
        return out

    @staticmethod
    def _level(scope: str, level: int, known: set[str]) -> str | None:
        """The ``level``-th enclosing known scope of ``scope`` (outermost first), or None."""
        parts = scope.split(".")
        chain = [".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in known]
        return chain[level - 1] if level <= len(chain) else None

    def _cut_between(self, a: int, b: int | None, cuts: list[int]) -> bool:
        if b is None:
            return True
        end_a, start_b = self._spans[a][1], self._spans[b][0]
        return any(end_a <= t <= start_b for t in cuts)

    def _enclosing(self, scope: str, first: int, last: int) -> dict:
        start, end = self._spans[first][0], self._spans[last][1]
        return {
            "name": scope,
            "cat": "scope",
            "ph": "X",
            "pid": self.events[first]["pid"],
            "tid": 0,
            "ts": start / 1e3,
            "dur": (end - start) / 1e3,
            "args": {},
        }

    def to_json(self) -> dict:
        self._resolve_cuda()
        # parents before children at equal start times, for viewers that nest by order
        events = sorted(self.scope_slices() + self.events, key=lambda e: (e["ts"], -e["dur"]))
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
