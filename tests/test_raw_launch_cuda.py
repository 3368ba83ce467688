"""Graph replays through cuda-python (draftgraph.runtime.execution.launch) against CUDAGraph.replay() (run on a GPU)."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.execution import launch as raw_launch
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import SMALL

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def captured(fn):
    static = torch.zeros(1024, device="cuda")
    fn(static)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static)
    return graph, static


def test_the_first_replay_tells_whether_a_graph_draws_random_numbers():
    index = torch.cuda.current_device()
    plain, out = captured(lambda t: t.add_(1.0))
    assert raw_launch.draws_no_random_numbers(plain, index)
    assert out[0].item() == 2.0  # the warm-up, then this replay (the capture itself runs nothing)
    random, _ = captured(lambda t: t.copy_(torch.rand_like(t)))
    assert not raw_launch.draws_no_random_numbers(random, index)


def test_a_raw_launch_replays_the_graph_on_the_current_stream():
    plain, out = captured(lambda t: t.add_(1.0))
    handle = raw_launch.exec_handle(plain)
    assert handle is not None
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(5_000_000)  # the launch must queue behind this kernel
        out.fill_(10.0)
        raw_launch.launch(handle, torch.cuda.current_device())
    side.synchronize()
    assert bool((out == 11.0).all())


def test_the_launcher_replays_the_graph_on_the_current_stream():
    """``launcher``'s closure launches as ``launch`` does, queued on the calling thread's stream."""
    plain, out = captured(lambda t: t.add_(1.0))
    launch = raw_launch.launcher(raw_launch.exec_handle(plain), torch.cuda.current_device())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(5_000_000)
        out.fill_(10.0)
        launch()
        launch()
    side.synchronize()
    assert bool((out == 12.0).all())


@pytest.fixture
def launches(monkeypatch):
    """Each launch of an executor's launcher appends the device index."""
    calls = []
    real = raw_launch.launcher

    def counting_launcher(handle, index):
        launch = real(handle, index)

        def counting():
            calls.append(index)
            launch()

        return counting

    monkeypatch.setattr(raw_launch, "launcher", counting_launcher)
    return calls


def test_a_propose_launches_through_cuda_python_after_its_first_replay(launches, monkeypatch):
    tensors = random_mtp_weights(SMALL, seed=8)
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    results = {}
    for mode in ("torch", "raw"):
        monkeypatch.setattr(raw_launch, "is_enabled", mode == "raw")
        prop = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured")
        state = prop.alloc_state()
        rounds = []
        for i in range(4):
            launches.clear()
            rounds.append((prop.propose(5 + i, hidden, 40 + i, 2, state), prop.last_hidden()))
            # raw: the capture's first replay goes through torch (it checks the RNG), then cuda-python
            assert len(launches) == (int(i > 0) if mode == "raw" else 0)
        assert (prop._executor(1, 2, False)._exec is not None) == (mode == "raw")
        results[mode] = rounds
    for (drafts_t, hidden_t), (drafts_r, hidden_r) in zip(results["torch"], results["raw"]):
        assert drafts_t == drafts_r and torch.equal(hidden_t, hidden_r)


def test_a_dropped_graph_forgets_its_exec_handle():
    prop = DeepseekV4MtpProposer(SMALL, random_mtp_weights(SMALL, seed=9), device="cuda", executor="captured")
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    state = prop.alloc_state()
    for i in range(2):
        prop.propose(5, hidden, 40 + i, 1, state)
    executor = prop._executor(1, 1, False)
    assert executor._exec is not None
    prop.drop_executors()
    assert executor._exec is None and executor.is_released
