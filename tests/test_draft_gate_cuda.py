"""Confidence-gated drafting captured with CUDA conditional IF nodes (run on a GPU; skipped without CUDA).

The captured chain must stop where the eager chain stops, replay after replay, with the
conditions read on the device: the same drafts, probs and cache as the eager executor (which
reads each gate's flag on the host), and no allocation after warm-up.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import TINY

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def pair(tau: float, kernels: str):
    tensors = random_mtp_weights(TINY, seed=1)
    kw = {"draft_conf_tau": tau, "kernels": kernels, "buckets": (1, 4)}
    eager = DeepseekV4MtpProposer(TINY, tensors, device="cuda", executor="eager", **kw)
    captured = DeepseekV4MtpProposer(TINY, tensors, device="cuda", executor="captured", poison_arena=True, **kw)
    return eager, captured


def inputs(gen, batch: int):
    tokens = [int(x) for x in torch.randint(TINY.vocab_size, (batch,), generator=gen)]
    hiddens = [torch.randn(TINY.hc_mult, TINY.hidden_size, generator=gen).bfloat16().cuda() for _ in range(batch)]
    return tokens, hiddens


def median_first_prob(kernels: str) -> float:
    """A tau near the middle of this model's top-1 probs, so that chains stop at varied points."""
    prop = DeepseekV4MtpProposer(TINY, random_mtp_weights(TINY, seed=1), device="cuda", executor="eager",
                                 kernels=kernels, buckets=(4,))
    gen = torch.Generator().manual_seed(0)
    states = [prop.alloc_state() for _ in range(4)]
    conf: list = []
    prop.propose_batch(*inputs(gen, 4), [0, 0, 0, 0], 4, states, out_conf=conf)
    return float(torch.tensor(conf).flatten().median())


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("batch", [1, 3])
def test_captured_gated_chain_stops_where_eager_stops(batch, kernels):
    k = 4
    eager, captured = pair(median_first_prob(kernels), kernels)
    gen = torch.Generator().manual_seed(batch)
    states = {id(p): [p.alloc_state() for _ in range(batch)] for p in (eager, captured)}
    positions = [0] * batch
    lengths = set()
    for _ in range(30):  # the conditions change from replay to replay
        tokens, hiddens = inputs(gen, batch)
        results = []
        for prop in (eager, captured):
            conf: list = []
            drafts = prop.propose_batch(tokens, hiddens, positions, k, states[id(prop)], out_conf=conf)
            results.append((drafts, conf, prop.last_confidence(), prop.cache.kv.clone()))
        (a, ca, la, kva), (b, cb, lb, kvb) = results
        assert a == b and ca == cb and la == lb
        assert torch.equal(kva, kvb)
        lengths.update(len(row) for row in a)
        for prop in (eager, captured):
            for state, row in zip(states[id(prop)], a):
                prop.after_verify(len(row), state)
        positions = [p + len(row) + 1 for p, row in zip(positions, a)]
    assert len(lengths) > 1, f"every chain kept {lengths} drafts: the gates were never exercised"


def test_gated_graph_holds_one_conditional_node_per_gated_step():
    from draftgraph.runtime.execution import conditional as graph_conditional
    from draftgraph.tools.capture_dump import recapture

    assert graph_conditional.is_available(), "conditional nodes unavailable: the gates would run unconditionally"
    _, captured = pair(0.5, "auto")
    state = captured.alloc_state()
    captured.propose(1, torch.zeros(TINY.hc_mult, TINY.hidden_size, dtype=torch.bfloat16, device="cuda"), 0, 3,
                     state)
    executor = next(e for key, e in captured._executors.items() if key[0] == "chain")
    kept = recapture(executor)
    assert graph_conditional.count_conditional_nodes(kept.cuda_graph) == 2


def test_no_device_allocation_across_gated_proposes():
    _, captured = pair(median_first_prob("auto"), "auto")
    gen = torch.Generator().manual_seed(5)
    states = [captured.alloc_state() for _ in range(3)]
    positions = [0, 0, 0]
    for i in range(300):
        if i == 20:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        tokens, hiddens = inputs(gen, 3)
        drafts = captured.propose_batch(tokens, hiddens, positions, 4, states)
        for state, row in zip(states, drafts):
            captured.after_verify(len(row), state)
        positions = [p + len(row) + 1 for p, row in zip(positions, drafts)]
        positions = [p if p < 400 else 0 for p in positions]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
