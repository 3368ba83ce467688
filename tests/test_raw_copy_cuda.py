"""The staging copies through cuda-python (runtime/execution/raw_copy.py) against Tensor.copy_ (run on a GPU)."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.execution import raw_copy
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import SMALL

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def counted(monkeypatch):
    """Count the cudaMemcpyAsync calls, so a test knows which path a copy took."""
    calls = []
    real = raw_copy._memcpy

    def counting(*args):
        calls.append(args[2])
        real(*args)

    monkeypatch.setattr(raw_copy, "_memcpy", counting)
    return calls


def test_raw_copies_are_available_on_the_gpu_host():
    assert raw_copy.is_enabled  # else every propose pays torch's copy_ (the device has cuda-python)


def test_pinned_host_to_device_and_device_to_device(counted):
    host = torch.randint(0, 256, (4096 + 7,), dtype=torch.uint8).pin_memory()
    up = torch.full_like(host, 0xAB, device="cuda")
    raw_copy.copy_async(up, host, torch.cuda.current_device())
    hidden = torch.randn(4, 4096, device="cuda").bfloat16()
    across = torch.full_like(hidden, float("nan"))
    raw_copy.copy_async(across, hidden, torch.cuda.current_device())
    torch.cuda.current_stream().synchronize()
    assert counted == [host.nbytes, hidden.nbytes]
    assert torch.equal(up.cpu(), host)
    assert torch.equal(across, hidden)


def test_copies_are_ordered_on_the_current_stream(counted):
    side = torch.cuda.Stream()
    src = torch.zeros(1 << 20, device="cuda")
    dst = torch.full_like(src, float("nan"))
    with torch.cuda.stream(side):
        torch.cuda._sleep(5_000_000)  # the copy must wait for this kernel, queued before it
        src.fill_(3.0)
        raw_copy.copy_async(dst, src, torch.cuda.current_device())
    side.synchronize()
    assert counted == [src.nbytes]
    assert bool((dst == 3.0).all())


def test_strided_or_mismatched_copies_take_torch(counted):
    base = torch.randn(8, 64, device="cuda")
    strided = base[:, ::2]
    out = torch.empty(8, 32, device="cuda")
    raw_copy.copy_async(out, strided, torch.cuda.current_device())
    halves = torch.randn(8, 32, device="cuda").half()
    out2 = torch.empty(8, 32, device="cuda")
    raw_copy.copy_async(out2, halves, torch.cuda.current_device())  # a cast: same shape, other dtype
    torch.cuda.synchronize()
    assert counted == []
    assert torch.equal(out, strided)
    assert torch.equal(out2, halves.float())


def test_a_propose_stages_through_raw_copies(counted, monkeypatch):
    tensors = random_mtp_weights(SMALL, seed=3)
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    drafts = {}
    for mode in ("torch", "raw"):
        monkeypatch.setattr(raw_copy, "is_enabled", mode == "raw")
        prop = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured")
        prop.propose(5, hidden, 40, 2, prop.alloc_state())  # captures
        counted.clear()
        drafts[mode] = prop.propose(5, hidden, 40, 2, prop.alloc_state())
        # raw: the packed host buffer's copy is in the graph and the hidden is gathered there
        # from its address: no copy before the launch. torch: both go through copy_.
        assert counted == []
        assert prop._executor(1, 2, False).copies_staging == (mode == "raw")
    assert drafts["raw"] == drafts["torch"]


def test_the_captured_chain_starts_with_the_staging_kernel():
    from draftgraph.tools.capture_dump import kernels_per_op, recapture

    prop = DeepseekV4MtpProposer(SMALL, random_mtp_weights(SMALL, seed=3), device="cuda", executor="captured")
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    prop.propose(5, hidden, 40, 1, prop.alloc_state())
    executor = prop._executor(1, 1, False)
    assert executor.copies_staging
    # One kernel node copies the pinned buffer and gathers the hidden (draftgraph.ops.triton.rows.stage_from_host).
    assert kernels_per_op(recapture(executor))[0] == ("prologue", "(staging)", 1)


def test_the_captured_chain_ends_with_the_drafts_kernel_and_its_count_holds_it():
    """The epilogue (ChainStaging.in_graph_read) is one kernel node, and capture-dump's recapture,
    which the benchmarks' node count runs, keeps it (before 2026-12-06 it dropped it)."""
    from draftgraph.tools.capture_dump import count_kernel_nodes, kernels_per_op, recapture

    prop = DeepseekV4MtpProposer(SMALL, random_mtp_weights(SMALL, seed=3), device="cuda", executor="captured")
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    prop.propose(5, hidden, 40, 1, prop.alloc_state())
    executor = prop._executor(1, 1, False)
    assert executor.epilogue is not None
    rows = kernels_per_op(recapture(executor))
    assert rows[-1] == ("epilogue", "(drafts to host)", 1)
    assert count_kernel_nodes(executor) == sum(n for _, _, n in rows)


def test_pinned_memory_is_addressable_at_its_host_address():
    assert raw_copy.is_device_addressable(torch.zeros(64, dtype=torch.uint8, pin_memory=True))
    assert not raw_copy.is_device_addressable(torch.zeros(64, dtype=torch.uint8))  # pageable


def test_a_host_buffer_the_device_cannot_address_is_staged_by_a_memcpy_node(monkeypatch):
    from draftgraph.tools.capture_dump import kernels_per_op, node_types, recapture

    tensors = random_mtp_weights(SMALL, seed=3)
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    eager = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="eager")
    expected = eager.propose(5, hidden, 40, 2, eager.alloc_state())
    monkeypatch.setattr(raw_copy, "is_device_addressable", lambda host: False)
    prop = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured")
    prop.propose(5, hidden, 40, 2, prop.alloc_state())  # captures
    assert prop.propose(5, hidden, 40, 2, prop.alloc_state()) == expected
    executor = prop._executor(1, 2, False)
    assert executor.copies_staging
    kept = recapture(executor)
    assert kernels_per_op(kept)[0] == ("prologue", "(staging)", 0)  # the memcpy node, no kernel
    assert node_types(kept.cuda_graph)["Memcpy"] >= 1


def test_host_buffer_rewritten_between_replays_is_read_fresh():
    """Two proposes with other tokens and positions, each equal to an eager proposer's."""
    tensors = random_mtp_weights(SMALL, seed=4)
    captured = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured")
    eager = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="eager")
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    states = {id(p): p.alloc_state() for p in (captured, eager)}
    for token, position in [(5, 40), (17, 41), (3, 90)]:
        got = captured.propose(token, hidden, position, 2, states[id(captured)])
        assert got == eager.propose(token, hidden, position, 2, states[id(eager)])


@pytest.mark.parametrize("copy_in", [True, False], ids=["copy before the replay", "copy in the graph"])
def test_a_stage_waits_for_the_last_copy_not_for_the_graph_after_it(copy_in):
    """The next stage rewrites the host buffer once the last copy has read it, while the graph
    that copy feeds still runs (a decode loop stages its verify while its propose runs)."""
    from draftgraph.runtime.cache.staging import ChainStaging
    from draftgraph.runtime.ir.tensor_spec import TensorSpec
    from staging_fixtures import stage_rows

    st = ChainStaging(2, TensorSpec(("B", 8), torch.bfloat16), 4, 2, torch.device("cuda"), window=16)
    prologue = st.in_graph_copy(masked=False)
    assert prologue is not None
    token = st.views["token"]
    seen = torch.zeros(2, dtype=torch.int64, device="cuda")
    hidden = torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda")
    rows = [(3, 0, [0]), (4, 0, [1])]

    def body():
        if not copy_in:
            prologue()
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the graph still runs when the host stages again
        seen.copy_(token)

    stage_rows(st, rows, [7, 8], hidden, 100, copy_in=copy_in)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as CapturedExecutor does
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    seen.zero_()
    stage_rows(st, rows, [7, 8], hidden, 100, copy_in=copy_in)
    graph.replay()
    done = torch.cuda.Event()
    done.record()
    stage_rows(st, rows, [70, 80], hidden, 100, copy_in=copy_in)  # waits for the copy only
    assert not done.query(), "the stage waited for the whole graph"
    torch.cuda.synchronize()
    assert seen.tolist() == [7, 8], "the graph read the host buffer after the next stage rewrote it"


def test_synchronize_current_stream_waits_for_the_current_stream_only():
    """The read-back's wait (staging.read_rows): the current stream of the device, a side stream
    under ``torch.cuda.stream`` included, as ``torch.cuda.current_stream(device).synchronize()``."""
    index = torch.cuda.current_device()
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of one spinning kernel
            done = torch.cuda.Event()
            done.record()
            assert not done.query()
            raw_copy.synchronize_current_stream(index)
            assert done.query()
