"""Aliased execution equals unaliased execution (every value in its own buffer), bit for bit,
on random graphs, also with the arena poisoned (NaN / 0xFF) before the run; the value-level
plan passes the independent checker with only the declared aliases allowed."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.errors import ExecutionError, InputError, PlanError
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.passes import run_passes
from draftgraph.runtime.planning.graph_plan import plan_graph
from draftgraph.runtime.planning.verify_plan import verify_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_graphs import random_graph, random_inputs


def run_both(seed: int, batch: int, poison: int | None):
    graph, weights = random_graph(seed, num_nodes=14)
    inputs = random_inputs(graph, batch, seed)
    aliased = EagerExecutor(graph, batch, weights, debug=True)
    plain = EagerExecutor(graph, batch, weights, alias=False)
    if poison is not None:
        aliased.poison(poison)
    a = {k: v.clone() for k, v in aliased.run(inputs).items()}
    b = plain.run(inputs)
    return graph, aliased, a, b


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), batch=st.sampled_from([1, 3]), poison=st.sampled_from([None, 0xFF, 0x00]))
def test_aliased_equals_unaliased_bit_for_bit(seed, batch, poison):
    graph, executor, a, b = run_both(seed, batch, poison)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].contiguous().view(torch.uint8)), name
    plan = executor.plan
    assert plan.arena.arena_bytes <= plan.arena.naive_bytes
    assert plan.arena.arena_bytes >= plan.arena.lower_bound


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_value_level_plan_allows_only_declared_sharing(seed):
    graph, _ = random_graph(seed, num_nodes=16)
    plan = plan_graph(run_passes(graph).graph, 2)
    buffers = plan.value_buffers()
    by_name = {b.name: b for b in buffers}
    value_plan = type(plan.arena)(
        offsets={b.name: plan.offsets[b.name] for b in buffers}, buffers=tuple(buffers),
        arena_bytes=plan.arena.arena_bytes, naive_bytes=plan.arena.naive_bytes, lower_bound=plan.arena.lower_bound,
        alignment=plan.arena.alignment, strategy="values", planning_seconds=0.0,
    )
    verify_plan(value_plan, buffers, allowed_overlaps=plan.groups.declared_pairs())
    # Sharing a value's bytes with an undeclared live neighbour must be caught.
    pairs = [(x, y) for x in buffers for y in buffers
             if x.name < y.name and x.start < y.end and y.start < x.end
             and (x.name, y.name) not in plan.groups.declared_pairs()]
    if pairs:
        x, y = pairs[0]
        bad = dict(value_plan.offsets)
        bad[y.name] = bad[x.name]
        corrupt = type(plan.arena)(**{**value_plan.__dict__, "offsets": bad})
        with pytest.raises(PlanError):
            verify_plan(corrupt, buffers, allowed_overlaps=plan.groups.declared_pairs())
    assert all(b.name in by_name for b in buffers)


def test_inplace_and_view_really_alias():
    graph, weights = random_graph(3, num_nodes=30)
    plan = plan_graph(run_passes(graph).graph, 2)
    kinds = set(plan.groups.kind.values())
    assert "inplace" in kinds and "view" in kinds, kinds  # the generator exercises both declarations
    for member, root in plan.groups.root.items():
        assert plan.offsets[member] == plan.offsets[root]


def test_a_declared_graph_shares_bytes_only_by_views():
    """In-place reuse is the reuse_dying_inputs pass's doing: without it no output takes an input's bytes."""
    graph, _ = random_graph(3, num_nodes=30)
    kinds = set(plan_graph(graph, 2).groups.kind.values())
    assert kinds == {"view"}, kinds


def test_debug_check_catches_an_op_that_does_not_write_its_output():
    from draftgraph.runtime.ir.builder import GraphBuilder
    from draftgraph.runtime.ir.op_registry import OpDef, register
    from draftgraph.runtime.ir.tensor_spec import B, TensorSpec

    def lazy_impl(inputs, outputs, attrs, workspace):
        return None  # writes nothing

    def allocating_impl(inputs, outputs, attrs, workspace):
        return inputs[0] * 2  # allocates a new tensor instead of writing the view

    register(OpDef("test_lazy", "elementwise", lambda s, a: [s[0]], lazy_impl))
    register(OpDef("test_allocating", "elementwise", lambda s, a: [s[0]], allocating_impl))
    for op, match in (("test_lazy", "unwritten"), ("test_allocating", "new tensor")):
        b = GraphBuilder(op)
        x = b.input("x", TensorSpec((B, 4), torch.float32))
        b.output(b.op(op, [x]))
        ex = EagerExecutor(b.build(), 2, {}, debug=True)
        with pytest.raises(ExecutionError, match=match) as info:
            ex.run({"x": torch.ones(2, 4)})
        assert f"while executing %{op}" in str(info.value)


def test_execution_errors_name_the_node():
    graph, weights = random_graph(5, num_nodes=6)
    ex = EagerExecutor(graph, 2, weights)
    first = ex.steps[0]
    original = first.impl

    def boom(*args):
        raise RuntimeError("kaboom")

    first.impl = boom
    with pytest.raises(ExecutionError, match=rf"while executing %{first.node.name}.*kaboom"):
        ex.run(random_inputs(graph, 2, 5))
    first.impl = original


def test_a_bind_error_names_its_first_problems_on_its_first_line():
    """The CLI prints an error's first line only: it must say what is wrong, not just "cannot bind"."""
    from draftgraph.runtime.ir.builder import GraphBuilder
    from draftgraph.runtime.ir.tensor_spec import B, TensorSpec

    b = GraphBuilder("bind")
    x = b.input("x", TensorSpec((B, 4), torch.float32))
    ws = [b.weight(f"w{i}", TensorSpec((4, 4), torch.float32)) for i in range(10)]
    y = x
    for w in ws:
        y = b.op("linear", [y, w])
    b.output(y)
    weights = {f"w{i}": torch.zeros(4, 4) for i in range(10)}
    weights["w0"] = torch.zeros(4, 5)
    del weights["w1"]
    with pytest.raises(InputError) as info:
        EagerExecutor(b.build(), 2, weights)
    first, *rest = str(info.value).splitlines()
    assert first == ("cannot bind graph tensors: 2 problem(s): @w0: expected f32[4,4], got f32[4,5]; "
                     "@w1: missing (expected f32[4,4])")
    assert len(rest) == 2


@pytest.mark.parametrize("make, fragment", [
    (lambda g, w: EagerExecutor(g, 2, [w]), "weights: expected a mapping of value names to tensors, got list"),
    (lambda g, w: EagerExecutor(g, 2, {"w": "q"}), "weights: 1 problem(s): 'w': expected a tensor, got str"),
    (lambda g, w: EagerExecutor(g, 2, {"w": w}, state=3), "state: expected a mapping"),
    (lambda g, w: EagerExecutor(g, 2, {"w": w}).run(None), "graph inputs: expected a mapping of ['x'] to tensors"),
    (lambda g, w: EagerExecutor(g, 2, {"w": w}).run({"x": "a"}), "input %x: expected a tensor f32[B,4], got str"),
], ids=["weights a list", "a weight a str", "state an int", "inputs None", "an input a str"])
def test_executor_arguments_of_the_wrong_kind_are_input_errors(make, fragment):
    """Each was an AttributeError or TypeError from inside (a fuzz of the executor's arguments)."""
    from draftgraph.runtime.ir.builder import GraphBuilder
    from draftgraph.runtime.ir.tensor_spec import B, TensorSpec

    b = GraphBuilder("kinds")
    x = b.input("x", TensorSpec((B, 4), torch.float32))
    w = b.weight("w", TensorSpec((4, 4), torch.float32))
    b.output(b.op("linear", [x, w]))
    with pytest.raises(InputError) as info:
        make(b.build(), torch.randn(4, 4))
    assert fragment in str(info.value)
