"""Confidence-gated drafting (draft_conf_tau > 0): the ops, the chain graph, the proposer (CPU, eager).

The reference is the ungated chain: with the same weights and inputs its K drafts and probs
are what a loop that stops at the same point computes before it stops, so the gated propose
must return exactly the prefix the rule keeps, with the same probs and the same cache rows.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.graphs.v4_block import CacheGeometry
from draftgraph.ops.draft_gate import CUT, _cut_impl, _gate_impl
from draftgraph.runtime.errors import GraphError, InputError
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.runtime.ir.serialize import from_json, to_json
from draftgraph.runtime.ir.validate import validate
from proposer_fixtures import TINY, hidden, make_proposer


def kept_count(probs: list[float], tau: float) -> int:
    """The rule: draft k is kept while drafts 0..k-1 all had prob >= tau."""
    for j, p in enumerate(probs[:-1]):
        if not p >= tau:
            return j + 1
    return len(probs)


def tau_stopping_at(probs: list[float]) -> tuple[float, int] | None:
    """A tau that keeps a strict prefix of ``probs`` (n < K drafts), and n; None if none does."""
    for j in range(1, len(probs)):
        lowest = min(probs[:j])
        if lowest > probs[j] and j + 1 < len(probs):
            return (lowest + probs[j]) / 2, j + 1
    return None


# ---- the ops ------------------------------------------------------------------------------


def test_gate_keeps_rows_above_tau_and_ignores_padded_rows():
    prob = torch.tensor([0.9, 0.2, 0.95, float("nan")])
    positions = torch.tensor([5, 6, 0, 9])
    kv_start = torch.tensor([0, 0, 1, 0], dtype=torch.int32)  # row 2 is padding (kv_start 1 > pos 0)
    alive, go = torch.full((4,), 7, dtype=torch.int32), torch.full((1,), 7, dtype=torch.int32)
    _gate_impl([prob, positions, kv_start], [alive, go], {"tau": 0.5}, None)
    assert alive.tolist() == [1, 0, 1, 0] and go.tolist() == [1]
    _gate_impl([prob, positions, kv_start, torch.tensor([0, 1, 1, 1], dtype=torch.int32)], [alive, go],
               {"tau": 0.5}, None)
    assert alive.tolist() == [0, 0, 1, 0]
    assert go.tolist() == [0], "only the padded row is alive: the chain stops"


def test_cut_writes_minus_one_after_a_row_stops_or_a_step_did_not_run():
    drafts = torch.tensor([[11, 12, 13], [21, 22, 23]])
    alive1, go1 = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    alive2, go2 = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    out = torch.empty_like(drafts)
    _cut_impl([drafts, alive1, go1, alive2, go2], [out], {}, None)
    assert out.tolist() == [[11, 12, CUT], [21, CUT, CUT]]
    _cut_impl([drafts, alive1, go1, alive2, go2], [drafts], {}, None)  # in place, as planned
    assert drafts.tolist() == out.tolist()


def test_gated_chain_graph_guards_each_later_step():
    graph = flatten(build_draft_chain(TINY, CacheGeometry(64, 4, 16), ChainSpec(num_drafts=3, conf_tau=0.5)))
    guards = {node.name: node.guard for node in graph.nodes.values()}
    for name, guard in guards.items():
        want = {"d1": "g1.gate.go", "d2": "g2.gate.go"}.get(name.split(".")[0])
        assert guard == want, f"%{name}: expected guard {want}, got {guard}"
    assert sum(g == "g2.gate.go" for g in guards.values()) > 10  # the body's inlined nodes too
    assert "when %g1.gate.go" in format_graph(graph)
    assert {n.name: n.guard for n in from_json(to_json(graph)).nodes.values()} == guards
    for ungated in (ChainSpec(num_drafts=3), ChainSpec(num_drafts=1, conf_tau=0.5)):
        chain = flatten(build_draft_chain(TINY, CacheGeometry(64, 4, 16), ungated))
        assert all(node.guard is None for node in chain.nodes.values())


def test_a_gated_region_split_by_the_schedule_is_refused():
    prop = make_proposer(TINY)
    graph = flatten(build_draft_chain(TINY, prop.geometry, ChainSpec(num_drafts=3, conf_tau=0.5)))
    for node in graph.nodes.values():  # d1 and d2 under one gate, with g2's gate between them
        if node.guard == "g2.gate.go":
            node.guard = "g1.gate.go"
    with pytest.raises(GraphError, match="one unbroken run of the schedule"):
        EagerExecutor(graph, 1, prop.weights, prop.state_tensors)


def test_a_guard_must_be_one_int32_flag():
    graph = flatten(build_draft_chain(TINY, CacheGeometry(64, 4, 16), ChainSpec(num_drafts=2, conf_tau=0.5)))
    for node in graph.nodes.values():
        if node.guard is not None:
            node.guard = "g1.gate.alive"  # i32[B], not i32[1]
    with pytest.raises(GraphError, match=r"guard %g1.gate.alive: expected i32\[1\], got i32\[B\]"):
        validate(graph)


# ---- the proposer -------------------------------------------------------------------------


def reference(k: int, pos: int, seed: int = 3):
    """The ungated chain's drafts and probs for one sequence, with its proposer and state."""
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    conf: list = []
    drafts = prop.propose_batch([5], [hidden(TINY, torch.Generator().manual_seed(seed))], [pos], k, [state],
                                out_conf=conf)
    return drafts[0], conf[0], prop, state


def test_gated_propose_keeps_the_prefix_an_eager_loop_would():
    k, pos, seed = 4, 0, 9  # seed 9's probs allow a stop after 3 of 4 drafts
    want, probs, ref, ref_state = reference(k, pos, seed)
    found = tau_stopping_at(probs)
    assert found is not None, f"probs {probs} allow no early stop: pick another seed"
    tau, n = found
    assert kept_count(probs, tau) == n < k
    prop = make_proposer(TINY, draft_conf_tau=tau)
    state = prop.alloc_state()
    gen = torch.Generator().manual_seed(seed)
    conf: list = []
    got = prop.propose_batch([5], [hidden(TINY, gen)], [pos], k, [state], out_conf=conf)
    assert got == [want[:n]]
    assert conf == [probs[:n]]
    assert prop.last_confidence() == pytest.approx(min(probs[:n]), abs=0)
    assert state.last_num_drafted == n and prop.drafter_rows(state) == n
    rows = [state.table.slot(p) for p in range(pos, pos + n)]
    ref_rows = [ref_state.table.slot(p) for p in range(pos, pos + n)]
    assert torch.equal(prop.cache.kv[rows], ref.cache.kv[ref_rows]), "the kept drafts' cache rows differ"
    prop.after_verify(n, state)
    prop.free_state(state)
    assert prop.cache.num_free_blocks == prop.cache.num_blocks, "blocks leaked"


def test_tau_one_drafts_once_and_tiny_tau_drafts_all():
    k = 3
    want, probs, *_ = reference(k, 0)
    for tau, n in ((1.0, 1), (1e-9, k)):
        prop = make_proposer(TINY, draft_conf_tau=tau)
        state = prop.alloc_state()
        gen = torch.Generator().manual_seed(3)
        assert prop.propose(5, hidden(TINY, gen), 0, k, state) == want[:n]


def batch_propose(k: int, seeds, tau: float) -> tuple[list, list, object, list]:
    """propose_batch of one row per seed at position 0, bucket 4 (3 rows: one padded)."""
    prop = make_proposer(TINY, draft_conf_tau=tau, buckets=(4,))
    states = [prop.alloc_state() for _ in seeds]
    hiddens = [hidden(TINY, torch.Generator().manual_seed(seed)) for seed in seeds]
    conf: list = []
    drafts = prop.propose_batch([5] * len(seeds), hiddens, [0] * len(seeds), k, states, out_conf=conf)
    return drafts, conf, prop, states


def test_batch_rows_stop_on_their_own():
    k, seeds = 4, (9, 6, 8)
    want, probs, *_ = batch_propose(k, seeds, 0.0)  # ungated, same bucket: same rounding as the gated run
    tau, _ = tau_stopping_at(probs[0])
    counts = [kept_count(row, tau) for row in probs]
    assert counts == [3, 4, 1], f"the seeds no longer stop at 3, 4 and 1 drafts: {counts}"
    got, conf, prop, states = batch_propose(k, seeds, tau)
    for want_row, probs_row, row, row_conf, state, n in zip(want, probs, got, conf, states, counts):
        assert row == want_row[:n] and row_conf == probs_row[:n] and state.last_num_drafted == n
    for state in states:
        prop.free_state(state)
    assert prop.cache.num_free_blocks == prop.cache.num_blocks


@pytest.mark.parametrize("tau", [-0.1, 1.5])
def test_bad_tau_is_refused(tau):
    with pytest.raises(InputError, match="draft_conf_tau"):
        make_proposer(TINY, draft_conf_tau=tau)


class NodeRecorder:
    """A tracer that records the names of the nodes the executor runs."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def begin(self, node) -> None:
        self.names.append(node.name)

    def end(self, node) -> None:
        pass


def test_a_stopped_chain_does_not_run_its_later_steps():
    prop = make_proposer(TINY, draft_conf_tau=1.0)  # every top-1 prob is below 1: stop after draft 0
    prop.tracer = recorder = NodeRecorder()
    state = prop.alloc_state()
    assert len(prop.propose(5, hidden(TINY, torch.Generator().manual_seed(3)), 0, 3, state)) == 1
    ran = {name.split(".")[0] for name in recorder.names}
    assert {"d0", "g1", "g2", "drafts"} <= ran and not ran & {"d1", "d2"}, sorted(ran)
