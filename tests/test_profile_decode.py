"""benchmarks/profile_decode.py's arithmetic on a timeline (the profiling itself needs CUDA)."""

from __future__ import annotations

import profile_decode as pd
from profile_decode import GRAPH_LAUNCH, Record


def test_union_counts_overlaps_once():
    assert pd.union_ns([(0, 10), (5, 20), (30, 40), (35, 36)]) == 30
    assert pd.union_ns([]) == 0


def test_a_step_of_two_graphs_an_eager_copy_and_a_wait():
    """Host: launch graph 1 (3 kernels), launch graph 2 (2 kernels), an eager copy, a blocking sync, 40
    us of host work, the next launch. Device: the kernels with gaps between them."""
    host = [Record(False, GRAPH_LAUNCH, 1, 0, 4_000), Record(False, GRAPH_LAUNCH, 2, 5_000, 9_000),
            Record(False, "cudaMemcpyAsync", 3, 10_000, 12_000),
            Record(False, "cudaStreamSynchronize", 0, 12_000, 100_000),
            Record(False, GRAPH_LAUNCH, 4, 140_000, 144_000)]
    device = [Record(True, "k1", 1, 10_000, 20_000), Record(True, "k2", 1, 22_000, 30_000),
              Record(True, "k3", 1, 31_000, 40_000),  # graph 1: span 30 us, kernels 27
              Record(True, "k4", 2, 41_000, 60_000), Record(True, "k5", 2, 60_000, 70_000),  # graph 2: 29, 29
              Record(True, "copy", 3, 71_000, 72_000),  # outside any graph
              Record(True, "k1", 4, 150_000, 160_000)]  # the next step's first graph (one kernel seen)
    out = pd.summarise(host + device)
    assert out["busy_ns"] == 27_000 + 29_000 + 1_000 + 10_000
    assert out["outside"] == 1
    assert out["graphs"] == {3: [(30_000, 27_000)], 2: [(29_000, 29_000)], 1: [(10_000, 10_000)]}
    assert out["gaps"] == [40_000]  # the sync's end to the next launch; the short copy call is no wait
    assert out["waits"] == {"cudaStreamSynchronize": [88_000]}


def test_every_synchronize_is_a_wait_and_a_copy_only_when_it_blocked():
    """A device-wide synchronize on an idle GPU returns in a few us: still a wait a step (the call
    the decode loop's staging made twice a step before ce27075); a copy call counts once it blocked."""
    host = [Record(False, "cudaDeviceSynchronize", 0, 0, 3_000), Record(False, "cudaMemcpyAsync", 1, 4_000, 6_000),
            Record(False, GRAPH_LAUNCH, 2, 7_000, 9_000), Record(False, "cudaDeviceSynchronize", 0, 10_000, 50_000),
            Record(False, "cudaMemcpyAsync", 3, 51_000, 80_000),
            Record(False, "cudaEventSynchronize", 0, 81_000, 82_000)]
    out = pd.summarise(host)
    assert out["waits"] == {"cudaDeviceSynchronize": [3_000, 40_000], "cudaMemcpyAsync": [29_000],
                            "cudaEventSynchronize": [1_000]}
    assert out["gaps"] == []  # no launch after a blocking call


def test_idle_before_each_graph_from_event_spans():
    """Launch order: first step (0-80 us), continuation queued behind it (starts at 80: no idle),
    verify 30 us after the continuation's end; the next step's first graph 120 us after the verify."""
    spans = [("first", 0.0, 80.0), ("continue", 80.0, 140.0), ("verify", 170.0, 270.0),
             ("first", 390.0, 470.0), ("continue", 475.0, 535.0), ("verify", 535.0, 635.0)]
    out = pd.idle_before(spans)
    assert out["first"] == (2, 120.0, 80.0)  # the decode's first launch has no idle before it
    assert out["continue"] == (2, 2.5, 60.0)  # median of 0 and 5
    assert out["verify"] == (2, 15.0, 100.0)  # median of 30 and 0
    assert pd.idle_before([]) == {}
