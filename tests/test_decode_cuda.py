"""GPU: the captured decode loop (CUDA graphs for the target's row bucket and the K-draft chain)
gives the same tokens as the eager loop, and both equal the target's greedy decoding."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import OracleProposer, make_proposer, make_target, pools_full, prompts
from draftgraph.runtime.decode.loop import greedy_decode, speculative_decode

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

K, MAX_NEW = 3, 16
PROMPTS = prompts((3, 9, 20))


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_captured_loop_equals_eager_loop(mode):
    runs = {}
    for executor in ("eager", "captured"):
        target = make_target(mode=mode, executor=executor, device="cuda:0")
        proposer = make_proposer(mode=mode, executor=executor, device="cuda:0")
        greedy = greedy_decode(target, PROMPTS, MAX_NEW).tokens
        result = speculative_decode(target, proposer, PROMPTS, MAX_NEW, K)
        assert result.tokens == greedy, executor
        assert pools_full(target, proposer)
        runs[executor] = result.tokens
        if executor == "captured":
            assert target.use_captured and proposer.use_captured
            assert all(ex.cuda_graph is not None for ex in target._executors.values())
    assert runs["captured"] == runs["eager"]


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
