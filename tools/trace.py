"""Chrome-trace / Perfetto JSON of graph runs: one slice per op, nested under its node.

On CPU each op is timed with host timers; on CUDA with CUDA events recorded
around it (read after the run, so timing does not add syncs inside it). Ops of
a subgraph (the body) are nested under a slice named after their scope, e.g.
``d0.body``. A captured replay is one launch, so it appears as one slice.
Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import time

import torch


class Tracer:
    def __init__(self) -> None:
        self.events: list[dict] = []
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

    def slice(self, name: str, start_ns: int, dur_ns: int, cat: str = "run", args: dict | None = None) -> None:
        """A free-standing slice (a whole propose, a captured replay)."""
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": os.getpid(), "tid": 0,
                            "ts": (start_ns - self._origin) / 1e3, "dur": dur_ns / 1e3, "args": args or {}})

    def _add(self, node, start_ns: int, dur_ns: int) -> None:
        self.events.append({"name": node.name, "cat": node.op, "ph": "X", "pid": os.getpid(), "tid": 0,
                            "ts": (start_ns - self._origin) / 1e3, "dur": dur_ns / 1e3,
                            "args": {"op": node.op, "scope": node.scope}})

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
        """One enclosing slice per run of consecutive ops sharing a scope (nesting for the viewer)."""
        out, run = [], []
        ops = sorted((e for e in self.events if e["cat"] not in ("run", "scope")), key=lambda e: e["ts"])
        for event in ops + [None]:
            scope = event["args"].get("scope") if event else None
            if run and (scope != run[0]["args"]["scope"]):
                first, last = run[0], run[-1]
                out.append({"name": run[0]["args"]["scope"], "cat": "scope", "ph": "X", "pid": first["pid"],
                            "tid": 0, "ts": first["ts"], "dur": last["ts"] + last["dur"] - first["ts"], "args": {}})
                run = []
            if event is not None and scope:
                run.append(event)
        return out

    def to_json(self) -> dict:
        self._resolve_cuda()
        return {"traceEvents": self.events + self.scope_slices(), "displayTimeUnit": "ms"}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
