"""draftgraph.tools.trace.Tracer on the eager executor: one slice per op, body ops nested in their scope."""

from __future__ import annotations

import json
import time

import torch
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.tools.trace import Tracer

F32 = torch.float32
EPS_US = 1e-6  # float slack when comparing microsecond timestamps


def _linear(b: GraphBuilder, x, weight: str, name: str):
    return b.op("linear", [x, b.weight(weight, TensorSpec((8, 8), F32))], name=name)


def scoped_graph(nested: bool = False, body_only: bool = False):
    """x -> d0.pre -> d0.body(proj [-> leaf(proj2)] -> res) -> out, as built (body is a subgraph)."""
    leaf = GraphBuilder("leaf")
    x = leaf.input("x", TensorSpec((B, 8), F32))
    leaf.output(_linear(leaf, x, "w2", "proj2"))
    inner = GraphBuilder("inner")
    x = inner.input("x", TensorSpec((B, 8), F32))
    y = _linear(inner, x, "w1", "proj")
    if nested:
        y = inner.subgraph("leaf", leaf.build(), [y])
    inner.output(inner.op("add", [y, x], name="res"))
    b = GraphBuilder("outer")
    x = b.input("x", TensorSpec((B, 8), F32))
    with b.scoped("d0"):
        h = x if body_only else _linear(b, x, "w0", "pre")
        out = b.subgraph("body", inner.build(), [h])
    b.output(out)
    return b.build()


def traced_run(graph, num_runs: int = 1, run_slices: bool = False) -> tuple[dict, Tracer]:
    gen = torch.Generator().manual_seed(0)
    weights = {v.name: torch.randn(v.spec.shape, generator=gen) for v in flatten(graph).weights}
    executor = EagerExecutor(graph, batch=2, weights=weights, device="cpu")
    tracer = Tracer()
    executor.tracer = tracer
    for _ in range(num_runs):
        start = time.perf_counter_ns()
        executor.run({"x": torch.randn(2, 8, generator=gen)})
        if run_slices:
            tracer.slice("run", start, time.perf_counter_ns() - start)
    return tracer.to_json(), tracer


def _contains(outer: dict, inner: dict) -> bool:
    return (
        outer["ts"] <= inner["ts"] + EPS_US
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPS_US
    )


def test_one_slice_per_op_and_valid_json(tmp_path):
    graph = scoped_graph()
    _, tracer = traced_run(graph)
    path = tmp_path / "trace.json"
    tracer.save(str(path))
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list)
    ops = [e for e in data["traceEvents"] if e["cat"] not in ("scope", "run")]
    flat = flatten(graph)
    assert sorted(e["name"] for e in ops) == sorted(flat.nodes), ops
    for event in data["traceEvents"]:
        assert event["ph"] == "X" and event["dur"] >= 0 and {"ts", "pid", "tid", "name"} <= set(event), event
    for e in ops:
        assert e["cat"] == flat.nodes[e["name"]].op and e["args"]["scope"] == flat.nodes[e["name"]].scope


def test_body_ops_nest_inside_their_scope_slice():
    data, _ = traced_run(scoped_graph())
    scopes = [e for e in data["traceEvents"] if e["cat"] == "scope"]
    assert [s["name"] for s in scopes] == ["d0.body"], scopes
    body_ops = [e for e in data["traceEvents"] if e["name"].startswith("d0.body.")]
    assert {e["name"] for e in body_ops} == {"d0.body.proj", "d0.body.res"}
    for op in body_ops:
        assert _contains(scopes[0], op), (scopes[0], op)
    outside = next(e for e in data["traceEvents"] if e["name"] == "d0.pre")
    assert outside["ts"] + outside["dur"] <= scopes[0]["ts"] + EPS_US, "d0.pre is not part of the body"
    events = data["traceEvents"]
    assert events.index(scopes[0]) < min(events.index(op) for op in body_ops), "parents come first"


def test_nested_subgraph_scopes_nest():
    data, _ = traced_run(scoped_graph(nested=True))
    scopes = {e["name"]: e for e in data["traceEvents"] if e["cat"] == "scope"}
    assert set(scopes) == {"d0.body", "d0.body.leaf"}, scopes
    assert _contains(scopes["d0.body"], scopes["d0.body.leaf"])
    leaf_op = next(e for e in data["traceEvents"] if e["name"] == "d0.body.leaf.proj2")
    assert _contains(scopes["d0.body.leaf"], leaf_op)


def test_scope_slices_do_not_span_two_runs():
    graph = scoped_graph(body_only=True)  # every op is in d0.body: back-to-back runs would merge
    data, _ = traced_run(graph, num_runs=2, run_slices=True)
    scopes = [e for e in data["traceEvents"] if e["cat"] == "scope"]
    runs = [e for e in data["traceEvents"] if e["cat"] == "run"]
    assert len(runs) == 2 and len(scopes) == 2, scopes
    for scope, run in zip(sorted(scopes, key=lambda e: e["ts"]), sorted(runs, key=lambda e: e["ts"])):
        assert _contains(run, scope), (run, scope)
