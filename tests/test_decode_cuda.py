"""GPU: the captured decode loop (CUDA graphs for the target's row bucket and the K-draft chain)
gives the same tokens as the eager loop, and both equal the target's greedy decoding; the device
loop's verify graph is captured too; after warm-up a long decode captures and compiles nothing."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import OracleProposer, make_proposer, make_target, pools_full, prompts
from draftgraph.runtime.decode.loop import DecodeSession, greedy_decode, speculative_decode
from draftgraph.runtime.decode.warmup import BuildCounts, build_counts, compile_counting

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

K, MAX_NEW = 3, 16
PROMPTS = prompts((3, 9, 20))


@pytest.mark.parametrize("device_loop", [True, False])
@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_captured_loop_equals_eager_loop(mode, device_loop):
    runs = {}
    for executor in ("eager", "captured"):
        target = make_target(mode=mode, executor=executor, device="cuda:0")
        proposer = make_proposer(mode=mode, executor=executor, device="cuda:0")
        greedy = greedy_decode(target, PROMPTS, MAX_NEW).tokens
        result = speculative_decode(target, proposer, PROMPTS, MAX_NEW, K, device_loop=device_loop)
        assert result.tokens == greedy, executor
        assert pools_full(target, proposer)
        runs[executor] = result.tokens, result.stats.num_accepted  # the same drafts: the same acceptance
        if executor == "captured":
            assert target.use_captured and proposer.use_captured
            assert all(ex.cuda_graph is not None for ex in target._executors.values())
            if device_loop:
                verifier = target.device_verifier(K)
                assert verifier._executors and all(ex.cuda_graph is not None for ex in verifier._executors.values())
            if device_loop:  # the verdict, once a step
                assert result.stats.num_read_backs == result.stats.num_steps
    assert runs["captured"] == runs["eager"]


@pytest.mark.parametrize("executor", ["captured", "eager"])
def test_no_capture_or_compile_after_warm_up(executor):
    """Issue 27.4: a few hundred tokens a sequence, the batch shrinking as sequences end: every CUDA
    graph and every Triton kernel is made in the warm-up, none in the steps."""
    assert compile_counting(), "no Triton compile hook: the test would count nothing"
    target = make_target(executor=executor, device="cuda:0")
    proposer = make_proposer(executor=executor, device="cuda:0", buckets=(1, 2, 4, 8, 16))
    max_new = 200
    greedy = greedy_decode(target, PROMPTS, max_new).tokens
    eos = next(t for t in greedy[0][10:] if t not in greedy[1] + greedy[2])  # sequence 0 ends early
    with DecodeSession(target, proposer, PROMPTS, max_new, K, eos_id=eos) as session:
        session.warm_up()
        before = build_counts()
        while session.step():
            pass
        result = session.result()
    assert build_counts() - before == BuildCounts(), executor
    assert result.finish_reasons == ["eos", "length", "length"]
    assert result.tokens[1:] == greedy[1:]
    assert pools_full(target, proposer)


def test_captured_loop_with_rollbacks_equals_greedy():
    target = make_target(executor="captured", device="cuda:0")
    greedy = greedy_decode(target, PROMPTS, MAX_NEW).tokens
    truths = [p + g for p, g in zip(PROMPTS, greedy)]
    proposer = make_proposer(cls=OracleProposer, truths=truths, executor="captured", device="cuda:0")
    counts = []
    result = speculative_decode(
        target, proposer, PROMPTS, MAX_NEW, K, on_step=lambda s, e: counts.extend(e.accepted.values())
    )
    assert result.tokens == greedy and set(counts) == {0, 1, 2, 3}
    assert pools_full(target, proposer)
