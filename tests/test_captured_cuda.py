"""CUDA Graph capture of the K-draft chain (run on a GPU; skipped without CUDA).

Captured replay equals the eager executor bit for bit, with the arena poisoned (NaN)
before every replay; padded rows write no cache row; nothing is allocated after warm-up.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import SMALL, TINY

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def pair(cfg=SMALL, **kw):
    tensors = random_mtp_weights(cfg, seed=1)
    eager = DeepseekV4MtpProposer(cfg, tensors, device="cuda", executor="eager", **kw)
    captured = DeepseekV4MtpProposer(cfg, tensors, device="cuda", executor="captured", poison_arena=True, **kw)
    return eager, captured


def hid(cfg, gen, mode, n=None):
    shape = (cfg.hc_mult, cfg.hidden_size) if mode == "streams" else (cfg.hidden_size,)
    shape = shape if n is None else (n, *shape)
    return torch.randn(*shape, generator=gen).bfloat16().cuda()


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # auto: the fused Triton kernels
@pytest.mark.parametrize("mode", ["streams", "collapsed"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 3])
def test_captured_equals_eager_bit_for_bit(mode, batch, k, kernels):
    check_captured_equals_eager(mode, batch, k, kernels)


def test_captured_compiled_ops_equal_eager_compiled_ops_bit_for_bit():
    check_captured_equals_eager("streams", 3, 3, "compiled")


def check_captured_equals_eager(mode, batch, k, kernels):
    eager, captured = pair(mode=mode, mtp_vocab_size=700, kernels=kernels)
    for prop in (eager, captured):
        prop.set_vocab_limit(650)
    gen = torch.Generator().manual_seed(batch * 10 + k)
    words = (SMALL.vocab_size + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (words,), generator=gen, dtype=torch.int64).to(torch.int32)
    states = {id(p): [p.alloc_state() for _ in range(batch)] for p in (eager, captured)}
    positions = [int(x) for x in torch.randint(0, 50, (batch,), generator=gen)]
    for round_index in range(4):
        tokens = [int(x) for x in torch.randint(SMALL.vocab_size, (batch,), generator=gen)]
        hs = [hid(SMALL, gen, mode) for _ in range(batch)]
        results = []
        for prop in (eager, captured):
            st = states[id(prop)]
            if batch == 1:
                out = [prop.propose(tokens[0], hs[0], positions[0], k, st[0],
                                    grammar_bitmask=mask if round_index % 2 else None)]
            else:
                out = prop.propose_batch(tokens, hs, positions, k, st)
            results.append((out, prop.last_hidden(batch), prop.cache.kv.clone()))
        (a, ha, kva), (b, hb, kvb) = results
        assert a == b
        assert torch.equal(ha, hb)
        assert torch.equal(kva, kvb)
        for prop in (eager, captured):
            for s in states[id(prop)]:
                prop.after_verify(round_index % (k + 1), s)
        positions = [p + round_index % (k + 1) + 1 for p in positions]


def test_100_replays_with_changing_inputs_and_interleavings():
    eager, captured = pair(TINY)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    st = {id(p): [p.alloc_state() for _ in range(4)] for p in (eager, captured)}
    pos = [0, 5, 17, 33]
    for _ in range(100):
        op = rng.choice(["propose", "batch", "verify"])
        k = rng.randint(1, 3)
        i = rng.randrange(4)
        tok = rng.randrange(TINY.vocab_size)
        h = hid(TINY, gen, "streams")
        outs = []
        for prop in (eager, captured):
            s = st[id(prop)]
            if op == "propose":
                outs.append(prop.propose(tok, h, pos[i], k, s[i]))
            elif op == "batch":
                outs.append(prop.propose_batch([tok] * 4, [h] * 4, pos, k, s))
            else:
                # after_verify is taken once per propose: a row with nothing to verify is skipped on both.
                if s[i].awaiting_verify:
                    prop.after_verify(min(1, s[i].last_num_drafted), s[i])
                outs.append(s[i].awaiting_verify)
        assert outs[0] == outs[1]
        assert torch.equal(eager.cache.kv, captured.cache.kv)
        if op != "verify":
            pos = [p + 1 for p in pos]


def test_padded_rows_write_no_cache_row():
    gen = torch.Generator().manual_seed(3)
    tensors = random_mtp_weights(SMALL, seed=2)
    prop = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured", buckets=(1, 4))
    states = [prop.alloc_state() for _ in range(3)]  # live batch 3 in bucket 4
    prop.cache.kv.normal_()
    before = prop.cache.kv.clone()
    hs = [hid(SMALL, gen, "streams") for _ in range(3)]
    drafts = prop.propose_batch([1, 2, 3], hs, [20, 40, 60], 3, states)
    changed = (prop.cache.kv != before).any(-1).nonzero().flatten().tolist()
    real = {s.table.slot(p + j) for s, p in zip(states, [20, 40, 60]) for j in range(3)}
    assert set(changed) <= real and len(changed) == len(real)
    # A full bucket of 4 live sequences gives the same rows for the first three.
    other = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured", buckets=(1, 4))
    other.cache.kv.copy_(before)
    ostates = [other.alloc_state() for _ in range(4)]
    full = other.propose_batch([1, 2, 3, 4], hs + [hs[0]], [20, 40, 60, 80], 3, ostates)
    assert full[:3] == drafts
    for s, o, p in zip(states, ostates, [20, 40, 60]):
        for j in range(3):
            assert torch.equal(prop.cache.kv[s.table.slot(p + j)], other.cache.kv[o.table.slot(p + j)])


def test_a_batched_hiddens_tensor_replays_as_the_list():
    """B = 3 in a bucket of 4, the hiddens as one [3, C, D] tensor: contiguous, its rows apart
    (gathered where they are), then strided inside its rows (copied once): the list's drafts and cache."""
    gen = torch.Generator().manual_seed(6)
    tensors = random_mtp_weights(SMALL, seed=6)
    props = [DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured", buckets=(1, 4))
             for _ in range(2)]
    states = [[prop.alloc_state() for _ in range(3)] for prop in props]
    positions = [20, 40, 60]
    for layout in ("contiguous", "step", "transposed"):
        tokens = [int(x) for x in torch.randint(SMALL.vocab_size, (3,), generator=gen)]
        block = hid(SMALL, gen, "streams", n=6)
        block = block[::2] if layout == "step" else block[:3]
        if layout == "transposed":
            block = block.transpose(0, -1).contiguous().transpose(0, -1)
        listed = props[0].propose_batch(tokens, [row.clone() for row in block], positions, 3, states[0])
        batched = props[1].propose_batch(tokens, block, positions, 3, states[1])
        assert batched == listed, layout
        assert torch.equal(props[0].cache.kv, props[1].cache.kv), layout
        for prop, st in zip(props, states):
            for s in st:
                prop.after_verify(1, s)
        positions = [p + 1 for p in positions]


def test_no_device_allocation_after_warmup():
    gen = torch.Generator().manual_seed(4)
    prop = DeepseekV4MtpProposer(TINY, random_mtp_weights(TINY, seed=3), device="cuda", executor="captured",
                                 buckets=(1, 2, 4))
    prop.capture(num_drafts=(3,))
    state = prop.alloc_state()
    h = hid(TINY, gen, "streams")
    prop.propose(1, h, 0, 3, state)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i in range(1000):
        prop.propose(1, h, (i % 200) + 1, 3, state)
        prop.after_verify(1, state)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


def test_capture_largest_bucket_first_and_invalidation():
    prop = DeepseekV4MtpProposer(TINY, random_mtp_weights(TINY, seed=3), device="cuda", executor="captured",
                                 buckets=(1, 2, 4), num_cache_blocks=64)
    prop.capture(num_drafts=(1,))
    graphs = [e for e in prop._executors.values() if e.cuda_graph is not None]
    assert len(graphs) == 3
    old = list(prop._executors.values())
    prop.set_circuit_draft("identity")
    assert all(e.is_released for e in old) and not prop._executors
    from draftgraph.runtime.errors import CaptureError

    with pytest.raises(CaptureError, match="stale"):
        old[0].run(old[0].static_inputs)
    prop.set_buckets((1, 8))
    prop.load_weights(random_mtp_weights(TINY, seed=4))
    assert prop.generation == 3


def test_pdl_launches_equal_plain_launches_bit_for_bit():
    """The fused chain captured with programmatic dependent launch (the default on sm90+;
    GEMVs load their first weight tile before waiting) equals the same chain captured with
    plain launches, at batch 1 (slot-major MoE) and 3 (expert-major MoE)."""
    triton_common = pytest.importorskip("draftgraph.ops.triton._common")
    on_hopper = torch.cuda.get_device_capability()[0] >= 9
    assert triton_common.pdl_enabled(torch.device("cuda")) == on_hopper
    tensors = random_mtp_weights(SMALL, seed=2)
    props = []
    for pdl in (True, False):
        triton_common.set_pdl(pdl)
        try:
            prop = DeepseekV4MtpProposer(SMALL, tensors, device="cuda", executor="captured", kernels="auto")
            for batch in (1, 3):  # the first propose of a bucket captures it, with this PDL setting
                states = [prop.alloc_state() for _ in range(batch)]
                prop.propose_batch([1] * batch, [hid(SMALL, torch.Generator(), "streams") for _ in range(batch)],
                                   [0] * batch, 3, states)
                for s in states:
                    prop.free_state(s)
        finally:
            triton_common.set_pdl(None)
        props.append(prop)
    gen = torch.Generator().manual_seed(5)
    for batch in (1, 3, 1, 3):
        tokens = [int(x) for x in torch.randint(SMALL.vocab_size, (batch,), generator=gen)]
        hs = [hid(SMALL, gen, "streams") for _ in range(batch)]
        positions = [int(x) for x in torch.randint(0, 60, (batch,), generator=gen)]
        results = []
        for prop in props:
            states = [prop.alloc_state() for _ in range(batch)]
            drafts = prop.propose_batch(tokens, hs, positions, 3, states)
            results.append((drafts, prop.last_hidden(batch).clone()))
            for s in states:
                prop.free_state(s)
        assert results[0][0] == results[1][0]
        assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("publish", [True, False])
def test_the_captured_chain_writes_its_drafts_to_the_host_itself(publish, monkeypatch):
    """ChainStaging.in_graph_read: a captured chain's last node writes its drafts to pinned memory
    (copy_to_host) and read_rows reads them there, with no copy after the replay; the drafts and
    the cache equal the eager proposer's, with the switch on and off (the copy after the replay)."""
    from draftgraph.runtime.cache import staging as staging_module

    monkeypatch.setattr(staging_module, "PUBLISH_READS", publish)
    eager, captured = pair()
    gen = torch.Generator().manual_seed(77)
    states = {id(p): [p.alloc_state() for _ in range(3)] for p in (eager, captured)}
    for round_index in range(3):
        tokens = [int(x) for x in torch.randint(SMALL.vocab_size, (3,), generator=gen)]
        hs = [hid(SMALL, gen, "streams") for _ in range(3)]
        got = [p.propose_batch(tokens, hs, [20 + 3 * round_index] * 3, 2, states[id(p)]) for p in (eager, captured)]
        assert got[0] == got[1]
        assert torch.equal(eager.cache.kv, captured.cache.kv)
        for p in (eager, captured):
            p.after_verify_batch([2, 2, 2], states[id(p)])
    st = captured._staging_for(captured._bucket(3))
    assert [tuple(t().shape) for t, _ in st._published] == ([(captured._bucket(3), 2)] if publish else [])
    if publish:  # a graph captured again (capture-dump's recapture) is not kept alive by the staging
        from draftgraph.tools.capture_dump import recapture

        kept = recapture(captured._executor(captured._bucket(3), 2, False))
        assert len(st._published) == 2 and st._published[1][0]() is kept.outputs["drafts"]
        del kept
        gc.collect()
        assert st._published[1][0]() is None
        tokens = [int(x) for x in torch.randint(SMALL.vocab_size, (3,), generator=gen)]
        hs = [hid(SMALL, gen, "streams") for _ in range(3)]
        got = [p.propose_batch(tokens, hs, [40] * 3, 2, states[id(p)]) for p in (eager, captured)]
        assert got[0] == got[1]
    assert bool(st._read_bufs) != publish  # the copy path's pinned buffers: only without the switch
