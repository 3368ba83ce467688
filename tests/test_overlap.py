"""Side-stream overlap (draftgraph.ops.overlap): where the executor forks and joins, checked on the CPU.

A fake side stream stands in for the CUDA one: its blocks run inline (so results are
exact) and it logs every fork, join event and wait, while a tracer logs each step. The
order of that log is what the CUDA stream calls would be; test_overlap_cuda.py runs the
real streams.
"""

from __future__ import annotations

import contextlib

import pytest
from draftgraph.ops.moe import can_grouped_mm
from draftgraph.ops.overlap import SideStream, pick_lane, side_stream
from draftgraph.runtime.errors import ExecutionError
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from proposer_fixtures import SMALL, hidden, make_proposer
from v4_op_cases import gen, hc_pre_case


class FakeSide:
    """SideStream's interface, logging instead of queueing on a stream."""

    serving = SideStream.serving

    def __init__(self, log: list[str]) -> None:
        self.log, self.forked, self.events = log, False, 0

    @contextlib.contextmanager
    def fork(self, urgent: bool = False):
        self.log.append("fork")
        self.forked = True
        yield

    def join_event(self) -> int:
        self.events += 1
        self.forked = False
        self.log.append(f"event {self.events}")
        return self.events

    def wait(self, event: int) -> None:
        self.log.append(f"wait {event}")


class StepLog:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def begin(self, node) -> None:
        self.log.append(f"{node.op} {node.name}")

    def end(self, node) -> None:
        pass


def logged(executor: EagerExecutor) -> list[str]:
    log: list[str] = []
    executor.side, executor.tracer = FakeSide(log), StepLog(log)
    return log


def propose_logged(num_drafts: int, overlap: bool):
    prop = make_proposer(SMALL, seed=3, kernels="torch")
    executor = prop._executor(1, num_drafts, False)
    log = logged(executor) if overlap else []
    prop.tracer = executor.tracer  # the proposer hands its tracer to the executor on every propose
    state = prop.alloc_state()
    drafts = prop.propose(11, hidden(SMALL, gen(4)), 20, num_drafts, state)
    return drafts, prop.last_outputs["probs"].clone(), prop.cache.kv.clone(), log, executor


def test_side_stream_is_inline_without_an_executor():
    ran = []
    with side_stream():
        ran.append(1)
    assert ran == [1]


def test_each_hc_pre_forks_and_joins_right_before_its_hc_post():
    _, _, _, log, executor = propose_logged(2, overlap=True)
    steps = [entry for entry in log if not entry.startswith(("fork", "event", "wait"))]
    pre_ops = ("hc_pre ", "hc_pre_norm ")  # hc_pre_norm: hc_pre with its norm folded (fold_norm_into_hc_pre)
    assert sum(s.startswith(pre_ops) for s in steps) == 4  # attn and ffn, two drafts
    for i, entry in enumerate(log):
        if not entry.startswith(pre_ops):
            continue
        assert log[i + 1 : i + 3] == ["fork", log[i + 2]] and log[i + 2].startswith("event")
        event = log[i + 2].split()[1]
        wait_at = log.index(f"wait {event}")
        reader = log[wait_at + 1]
        assert reader.startswith("hc_post "), f"{entry}: joined before {reader}, not its hc_post"
        hc_post = executor.graph.nodes[reader.split()[1]]
        pre = executor.graph.nodes[entry.split()[1]]
        assert pre.outputs[2] in hc_post.inputs  # the comb reader
        between = [s for s in log[i + 3 : wait_at] if not s.startswith(("fork", "event", "wait"))]
        assert any(s.startswith("swa_attention ") or s.startswith("moe ") for s in between), (
            f"{entry}: nothing ran beside the Sinkhorn")
    assert executor._pending == {}


def joined_inside(log: list[str], at: int) -> int:
    """The forks of the step logged at ``at``, checked to be joined before the step ends."""
    forks = 0
    while log[at + 1 + forks] == "fork":
        forks += 1
    event = log[at + 1 + forks]
    assert forks >= 1 and event.startswith("event"), log[at : at + 4]
    assert log[at + 2 + forks] == f"wait {event.split()[1]}", log[at : at + 4 + forks]
    return forks


def test_moe_forks_its_shared_expert_weights_and_up_gemm_and_joins_inside_the_step():
    _, _, _, log, executor = propose_logged(2, overlap=True)
    moe_at = [i for i, entry in enumerate(log) if entry.startswith(("moe ", "moe_hash "))]
    assert len(moe_at) == 2
    x = executor.steps[[s.node.op for s in executor.steps].index("moe")].inputs[0]
    grouped = can_grouped_mm(x, *(executor.bound[f"mtp.0.ffn.experts.stacked.{w}"] for w in ("w1", "w2", "w3")))
    # The shared expert before the router's first kernel, the routing weights after its top-k,
    # those weights in expert order, the up GEMM beside the gate GEMM (the gather path joins
    # before it reads the weights).
    for i in moe_at:
        assert joined_inside(log, i) == (4 if grouped else 2)


def test_attention_forks_its_kv_blocks_and_joins_inside_the_step():
    _, _, _, log, _ = propose_logged(2, overlap=True)
    attention_at = [i for i, entry in enumerate(log) if entry.startswith("swa_attention ")]
    assert len(attention_at) == 2
    for i in attention_at:
        # Two blocks on one lane: the latent kv, then (after the main stream's slot math)
        # the cache write and the key gather; joined before the scores.
        assert joined_inside(log, i) == 2


def test_the_combiner_forks_its_embedding_half_and_joins_inside_the_step():
    _, _, _, log, _ = propose_logged(2, overlap=True)
    combine_at = [i for i, entry in enumerate(log) if entry.startswith("embed_combiner ")]  # the pass folds embed in
    assert len(combine_at) == 2
    for i in combine_at:
        assert joined_inside(log, i) == 1  # enorm + e_proj, beside hnorm + h_proj; joined before the sum


def hc_pre_graph(read_comb: bool):
    """hc_pre alone; comb either read by hc_post or dropped (then its bytes are free at once)."""
    inputs, attrs = hc_pre_case(gen(7))
    X, fn, base, scale = inputs
    b = GraphBuilder("hc_pre_only")
    x = b.input("x", TensorSpec((B, *X.shape[1:]), X.dtype))
    ws = [b.weight(n, TensorSpec(t.shape, t.dtype)) for n, t in (("fn", fn), ("base", base), ("scale", scale))]
    y, post, comb = b.op("hc_pre", [x, *ws], name="pre", attrs=attrs)
    if read_comb:
        b.output(b.op("hc_post", [y, x, post, comb], name="post"))
    else:
        b.output(y)
        b.discard(post, comb)
    graph = b.build()
    return EagerExecutor(graph, X.shape[0], {"fn": fn, "base": base, "scale": scale}, kernels="torch"), X


def test_a_deferred_output_nobody_reads_is_joined_at_once():
    executor, X = hc_pre_graph(read_comb=False)
    log = logged(executor)
    executor.run({"x": X})
    assert log == ["hc_pre pre", "fork", "event 1", "wait 1"]


def test_a_run_ends_joined_and_a_failing_block_leaves_nothing_pending():
    executor, X = hc_pre_graph(read_comb=True)
    log = logged(executor)
    executor.run({"x": X})
    assert log == ["hc_pre pre", "fork", "event 1", "wait 1", "hc_post post"]
    log.clear()

    def fails_on_the_side_stream(*args):
        with side_stream():
            raise ZeroDivisionError

    executor.steps[0].impl = fails_on_the_side_stream
    with pytest.raises(ExecutionError, match="ZeroDivisionError|hc_pre"):
        executor.run({"x": X})
    assert log == ["hc_pre pre", "fork", "event 2", "wait 2"]  # what it queued is joined all the same
    assert executor._pending == {} and not executor.side.forked


@pytest.mark.parametrize("lanes,busy,urgent,picked", [
    (2, [], True, 0),  # a Sinkhorn: the high-priority lane
    (2, [], False, 1),  # anything else keeps lane 0 free for the next Sinkhorn
    (2, [0], False, 1),  # the shared expert's lane while the Sinkhorn holds lane 0
    (2, [0], True, 1),  # lane 0 busy: an urgent block still never queues behind it
    (2, [1], False, 0),
    (2, [0, 1], False, 0),  # all busy: the one forked longest ago
    (2, [1, 0], True, 1),
    (3, [0, 1], False, 2),
    (3, [], False, 1),
    (1, [], False, 0),
    (1, [0], True, 0),
])
def test_a_step_forks_onto_a_lane_without_unjoined_work(lanes, busy, urgent, picked):
    assert pick_lane(lanes, busy, urgent) == picked


def test_sms_are_left_for_lanes_only_while_lanes_run_and_always_put_back():
    import draftgraph.ops.overlap as overlap
    import torch

    get = torch._C._get_sm_carveout_experimental
    assert get() is None
    with overlap.sms_left_for_lanes():  # no executor offers lanes: nothing changes
        assert get() is None
    token = overlap._ACTIVE.set(object())  # what a step with lanes sees
    try:
        with overlap.sms_left_for_lanes():
            assert get() == overlap.LANE_SMS
        assert get() is None
        with pytest.raises(ZeroDivisionError), overlap.sms_left_for_lanes():
            raise ZeroDivisionError
        assert get() is None  # put back on the error path too
    finally:
        overlap._ACTIVE.reset(token)
