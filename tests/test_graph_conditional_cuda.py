"""Conditional nodes (draftgraph.runtime.execution.conditional) in real torch.cuda.graph captures (run on a GPU).

Each graph is captured once and replayed with the flags written on the device between
replays, so the tests see what the replayed graph decides, not what the capture did.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.execution import conditional as gc

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def pool():
    if not gc.is_available():
        pytest.skip(f"conditional nodes unavailable: {gc._unavailable_reason()}")
    return torch.cuda.graph_pool_handle()


def _int32(value: int = 0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int32, device="cuda")


def _replay(graph: torch.cuda.CUDAGraph) -> None:
    graph.replay()
    torch.cuda.synchronize()


def test_conditional_nodes_are_available_on_the_gpu_host():
    assert gc.is_available(), gc._unavailable_reason()  # the H200 host has cuda-python 13 and NVRTC


def test_if_node_runs_its_body_only_when_the_flag_is_set(pool):
    counter, before, after, flag = _int32(), _int32(), _int32(), _int32()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        before.add_(1)
        with gc.if_node(flag, pool):
            counter.add_(1)
        after.add_(1)
    seen = []
    for value in (1, 0, 1):
        flag.fill_(value)
        _replay(graph)
        seen.append(int(counter.item()))
    assert seen == [1, 1, 2]
    assert int(before.item()) == int(after.item()) == 3  # the work around the node always runs


def test_while_node_loops_until_the_body_clears_the_flag(pool):
    counter, limit, flag = _int32(), _int32(), _int32()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        with gc.while_node(flag, pool):
            counter.add_(1)
            torch.lt(counter, limit, out=flag)
    for start_flag, bound, trips in ((1, 5, 5), (1, 1, 1), (0, 5, 0)):
        counter.zero_()
        limit.fill_(bound)
        flag.fill_(start_flag)
        _replay(graph)
        assert int(counter.item()) == trips, (start_flag, bound)


def test_body_temporaries_come_from_the_graph_pool(pool):
    a = torch.randn(1 << 16, device="cuda")
    b = torch.randn_like(a)
    out = torch.zeros_like(a)
    flag = _int32(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        with gc.if_node(flag, pool):
            x = a * 2 + b  # two temporaries, freed when the capture ends
            out.copy_(x)
            del x
        after = out + 1  # an outer allocation after the node: also from the pool
    # Had the temporaries come from the general pool, these would now own their memory,
    # and each replay would write into them.
    clutter = [torch.full_like(a, 1e6) for _ in range(8)]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert all(bool((tensor == 1e6).all()) for tensor in clutter)
    torch.testing.assert_close(out, a * 2 + b)
    torch.testing.assert_close(after, out + 1)
    a.copy_(torch.randn_like(a))
    _replay(graph)
    torch.testing.assert_close(out, a * 2 + b)


def test_count_conditional_nodes(pool):
    flag = _int32()
    work = _int32()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, pool=pool):
        work.add_(1)
        with gc.if_node(flag, pool):
            work.add_(1)
        with gc.while_node(flag, pool):
            work.add_(1)
            flag.zero_()
        work.add_(1)
    assert gc.count_conditional_nodes(graph) == 2
    flag.fill_(1)
    _replay(graph)  # keep_graph=True: instantiated at the first replay
    assert int(work.item()) == 4


def test_two_if_nodes_in_sequence_each_with_its_flag(pool):
    first, second = _int32(), _int32()
    first_flag, second_flag = _int32(), _int32()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        with gc.if_node(first_flag, pool):
            first.add_(1)
        with gc.if_node(second_flag, pool):
            second.add_(1)
    seen = []
    for flags in ((1, 0), (0, 1), (1, 1), (0, 0)):
        first_flag.fill_(flags[0])
        second_flag.fill_(flags[1])
        _replay(graph)
        seen.append((int(first.item()), int(second.item())))
    assert seen == [(1, 0), (1, 1), (2, 2), (2, 2)]


def test_an_if_node_inside_a_while_node(pool):
    counter, limit, flag, odd, odd_flag = _int32(), _int32(5), _int32(1), _int32(), _int32()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        with gc.while_node(flag, pool):
            counter.add_(1)
            torch.remainder(counter, 2, out=odd_flag)
            with gc.if_node(odd_flag, pool):
                odd.add_(1)
            torch.lt(counter, limit, out=flag)
    _replay(graph)
    assert (int(counter.item()), int(odd.item())) == (5, 3)


def test_errors_leave_the_current_stream_alone(pool):
    wrong = torch.zeros(1, dtype=torch.int64, device="cuda")
    before = torch.cuda.current_stream()
    with pytest.raises(gc.ConditionalError, match="active"):  # not capturing
        with gc.if_node(_int32(1), pool):
            pytest.fail("the body must not run")
    assert torch.cuda.current_stream() == before

    counter, flag = _int32(), _int32(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        capturing = torch.cuda.current_stream()
        with pytest.raises(gc.ConditionalError, match="int32"):
            with gc.if_node(wrong, pool):
                pytest.fail("the body must not run")
        assert torch.cuda.current_stream() == capturing
        with pytest.raises(gc.ConditionalError, match="pool"):  # a pool the capture does not use
            with gc.while_node(flag, torch.cuda.graph_pool_handle()):
                pytest.fail("the body must not run")
        assert torch.cuda.current_stream() == capturing
        with gc.if_node(flag, pool):  # the capture is still good
            counter.add_(1)
    _replay(graph)
    assert int(counter.item()) == 1
    assert torch.cuda.current_stream() == before


def test_an_error_in_the_body_ends_its_capture_and_restores_the_stream(pool):
    work, flag = _int32(), _int32(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        capturing = torch.cuda.current_stream()
        with pytest.raises(ValueError, match="boom"):
            with gc.if_node(flag, pool):
                work.add_(1)
                raise ValueError("boom")
        assert torch.cuda.current_stream() == capturing
        assert torch.cuda.is_current_stream_capturing()  # the outer capture, untouched
        work.add_(1)  # the outer capture goes on; the graph itself is to be discarded
