"""Side-stream overlap on the GPU (draftgraph.ops.overlap): same results, a shorter critical path.

The torch hc_pre queues its Sinkhorn on the executor's side stream; hc_post joins it.
Eager and captured, with and without overlap, must give the same drafts, hiddens and
cache bit for bit; the captured graph keeps every kernel but takes the Sinkhorns off
the chain a replay waits for; nothing leaks.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import SMALL

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def proposer(executor: str, overlap: bool, tensors, **kw) -> DeepseekV4MtpProposer:
    return DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor=executor, kernels="torch",
                                 overlap=overlap, **kw)


@pytest.mark.parametrize("batch,k", [(1, 1), (1, 3), (3, 3)])
def test_overlap_equals_one_stream_bit_for_bit(batch, k):
    tensors = random_mtp_weights(SMALL, seed=5)
    props = {
        "serial eager": proposer("eager", False, tensors),
        "eager": proposer("eager", True, tensors),
        "captured": proposer("captured", True, tensors, poison_arena=True),
        "serial captured": proposer("captured", False, tensors),
    }
    assert props["eager"]._executor(batch if batch == 1 else 4, k, False).side is not None
    assert props["serial eager"]._executor(batch if batch == 1 else 4, k, False).side is None
    gen = torch.Generator().manual_seed(batch * 7 + k)
    states = {name: [p.alloc_state() for _ in range(batch)] for name, p in props.items()}
    positions = [int(x) for x in torch.randint(0, 40, (batch,), generator=gen)]
    for round_index in range(6):
        tokens = [int(x) for x in torch.randint(SMALL.vocab_size, (batch,), generator=gen)]
        hiddens = [torch.randn(SMALL.hc_mult, SMALL.hidden_size, generator=gen).bfloat16().cuda()
                   for _ in range(batch)]
        results = {}
        for name, prop in props.items():
            drafts = prop.propose_batch(tokens, hiddens, positions, k, states[name])
            results[name] = (drafts, prop.last_hidden(batch), prop.cache.kv.clone())
            for state in states[name]:
                prop.after_verify(round_index % (k + 1), state)
        reference = results.pop("serial eager")
        for name, (drafts, hidden, kv) in results.items():
            assert drafts == reference[0], name
            assert torch.equal(hidden, reference[1]), name
            assert torch.equal(kv, reference[2]), name
        positions = [p + round_index % (k + 1) + 1 for p in positions]


def captured_graph(overlap: bool, k: int):
    from draftgraph.tools.capture_dump import recapture

    prop = proposer("captured", overlap, random_mtp_weights(SMALL, seed=6))
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    prop.propose(5, hidden, 30, k, prop.alloc_state())
    return recapture(prop._executor(1, k, False)).cuda_graph


def test_overlap_keeps_every_kernel_and_shortens_the_critical_path():
    from draftgraph.tools.capture_dump import critical_path, node_types

    serial, forked = captured_graph(False, 1), captured_graph(True, 1)
    assert node_types(forked)["Kernel"] == node_types(serial)["Kernel"]
    serial_path, forked_path = critical_path(serial), critical_path(forked)
    assert serial_path == sum(node_types(serial).values()), "one stream: every node on one chain"
    # Two Sinkhorns of ~78 kernels each leave the chain; what stays is the longer of each
    # Sinkhorn and the attention / MoE beside it.
    assert forked_path <= serial_path - 50, (forked_path, serial_path)


def test_capture_dump_prints_the_critical_path(tmp_path, capsys):
    from draftgraph.tools.cli import main

    assert main(["capture-dump", "--out", str(tmp_path / "chain.dot"), "--kernels", "torch"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    nodes = int(header.split(": ")[1].split()[0])
    on_path = int(header.split(", ")[-1].split()[0])
    assert 0 < on_path < nodes, header
    total = next(line for line in out.splitlines() if line.startswith("total"))
    by_op, whole = int(total.split()[1]), int(total.split("whole graph: ")[1].rstrip(")"))
    assert by_op == whole, total  # every kernel node attributed: the ops and the staging prologue
    assert "(staging)" in out
    assert (tmp_path / "chain.dot").read_text().startswith("digraph")


def test_memory_is_flat_over_300_overlapped_proposes():
    prop = proposer("captured", True, random_mtp_weights(SMALL, seed=7))
    state = prop.alloc_state()
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    prop.propose(5, hidden, 30, 3, state)
    prop.after_verify(0, state)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(300):
        prop.propose(5 + i % 50, hidden, 30, 3, state)
        prop.after_verify(0, state)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("priority", ["1", "0"])
def test_sinkhorns_are_captured_at_high_priority_and_launched_with_node_priorities(priority, monkeypatch):
    from draftgraph.runtime.execution import launch as raw_launch
    from draftgraph.tools.capture_dump import kernel_priorities, recapture

    monkeypatch.setenv("DRAFTGRAPH_LANE_PRIORITY", priority)
    prop = proposer("captured", True, random_mtp_weights(SMALL, seed=6))
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    state = prop.alloc_state()
    first = prop.propose(5, hidden, 30, 1, state)
    prop.after_verify(0, state)
    assert prop.propose(5, hidden, 30, 1, state) == first  # the second propose: the node-priority exec
    executor = prop._executor(1, 1, False)
    if raw_launch.is_enabled:
        assert executor._own_exec is not None and executor._exec is executor._own_exec.handle
    urgent = sum(n for level, n in kernel_priorities(recapture(executor).cuda_graph).items() if level < 0)
    # Two Sinkhorns (attention, FFN), each of one kernel per normalisation (2 * iters - 1).
    assert urgent >= 2 * (2 * SMALL.hc_sinkhorn_iters - 1) if priority == "1" else urgent == 0
    own = executor._own_exec
    executor.release()
    assert executor._own_exec is None and (own is None or own.handle is None)  # destroyed, not leaked
