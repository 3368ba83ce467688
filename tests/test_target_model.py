"""The target graph and TargetModel: batched rows equal token-by-token, verify equals a longer prefill,
rollback, chunked prefill with a bounded pool, an independent nn.Module oracle, and errors."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import CFG, make_target, prompts, single_thread, weights  # noqa: F401
from draftgraph.graphs.target import build_target
from draftgraph.graphs.v4_block import CacheGeometry
from draftgraph.runtime.errors import CacheError, GraphError, InputError
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.schedule import flatten


def one_by_one(target, tokens):
    state = target.alloc_state()
    outs = [target.forward([state], [[t]], [state.length], final=True)[0] for t in tokens]
    target.free(state)
    return (
        torch.cat([o.logits for o in outs]),
        torch.cat([o.hiddens for o in outs]),
        [o.tokens[0] for o in outs],
    )


def test_graph_layers_cache_and_outputs():
    graph = build_target(CFG, CacheGeometry(num_slots=64, max_blocks_per_seq=4))
    assert graph.inputs == ["token", "positions", "kv_start", "block_table"]
    assert graph.outputs == ["logits", "next_token", "hidden"]
    flat = flatten(graph)
    assert flat.nodes["layers.0.moe"].op == "moe_hash" and flat.nodes["layers.1.moe"].op == "moe"
    caches = sorted(v.name for v in flat.values.values() if v.kind.value == "state")
    assert caches == ["layers.0.kv_cache", "layers.1.kv_cache"]
    assert str(graph.values["logits"].spec) == "f32[B,264]"
    assert graph.values["hidden"].spec.shape == ("B", CFG.hc_mult, CFG.hidden_size)
    collapsed = build_target(CFG, CacheGeometry(64, 4), mode="collapsed")
    assert collapsed.values["hidden"].spec.shape == ("B", CFG.hidden_size)
    with pytest.raises(GraphError, match="target mode"):
        build_target(CFG, CacheGeometry(64, 4), mode="bogus")


def test_prompt_as_one_batch_equals_token_by_token():
    tokens = prompts([40])[0]  # > bucket (3 chunked runs) and > window (blocks recycled on the way)
    target = make_target()
    state = target.alloc_state()
    out = target.prefill(state, tokens)
    assert state.length == 40 and len(state.table.held()) <= target.cache.max_blocks_at_rest()
    logits, hiddens, nexts = one_by_one(target, tokens)
    # One row bucket: the same GEMM shapes in both runs, so the rows are bit-identical.
    assert torch.equal(out.logits, logits) and torch.equal(out.hiddens, hiddens)
    assert out.tokens == nexts == out.logits.argmax(-1).tolist()
    # Several buckets: different row counts, equal within bf16 tolerance.
    varied = make_target(buckets=(1, 2, 4, 8, 64))
    state2 = varied.alloc_state()
    out2 = varied.prefill(state2, tokens)
    assert (out2.logits - logits).abs().max() < 0.1
    assert (out2.hiddens.float() - hiddens.float()).abs().max() < 0.1 * hiddens.float().abs().max()
    target.free(state)
    varied.free(state2)
    assert target.cache.num_free_blocks == target.cache.num_blocks


def test_prefill_then_verify_equals_prefill_of_the_longer_sequence_and_rollback():
    target = make_target()
    base, more, other = prompts([12, 4, 3], seed=3)
    long_state, state = target.alloc_state(), target.alloc_state()
    whole = target.prefill(long_state, base + more)
    target.prefill(state, base)
    verified = target.verify([state], [more], [12])[0]
    assert torch.equal(verified.logits, whole.logits[12:]) and torch.equal(
        verified.hiddens, whole.hiddens[12:]
    )
    assert verified.tokens == whole.tokens[12:] and state.length == 16
    # Reject all but the first verified token: roll back, then verify other tokens there.
    target.truncate(state, 13)
    again = target.verify([state], [other], [13])[0]
    alt_state = target.alloc_state()
    alt = target.prefill(alt_state, base + more[:1] + other)
    assert torch.equal(again.logits, alt.logits[13:]) and again.tokens == alt.tokens[13:]
    for s in (long_state, state, alt_state):
        target.free(s)
    assert target.cache.num_free_blocks == target.cache.num_blocks


def test_verify_runs_every_sequence_in_one_graph_run():
    target = make_target()
    ps = prompts((3, 9, 5), seed=4)
    windows = prompts((4, 4, 4), seed=5)
    states = [target.alloc_state() for _ in ps]
    for s, p in zip(states, ps):
        target.prefill(s, p)
    runs = []
    executor = target._executor(16)
    real_run = executor.run
    executor.run = lambda *a, **k: runs.append(1) or real_run(*a, **k)
    outs = target.verify(states, windows, [len(p) for p in ps])
    assert len(runs) == 1  # 12 rows, one bucket of 16
    for p, w, out in zip(ps, windows, outs):
        alone = target.alloc_state()
        ref = target.prefill(alone, p + w)
        assert torch.equal(out.logits, ref.logits[len(p) :]) and out.tokens == ref.tokens[len(p) :]
        target.free(alone)
    for s in states:
        target.free(s)
    assert target.cache.num_free_blocks == target.cache.num_blocks


def test_against_the_independent_nn_module_target():
    from draftgraph.runtime.model.tiny_model import TinyV4Target

    tokens = torch.tensor(prompts([24], seed=6)[0])
    ref = TinyV4Target(CFG).to(torch.bfloat16)
    ref.load_v4(weights(0))
    with torch.no_grad():
        ref_logits, ref_streams = ref.forward_seq(tokens[None])
    for mode in ("streams", "collapsed"):
        target = make_target(mode=mode)
        state = target.alloc_state()
        out = target.prefill(state, tokens.tolist())
        assert (out.logits - ref_logits[0]).abs().max() < 0.1, mode
        want = ref_streams[0] if mode == "streams" else ref.hc_head(ref_streams)[0]
        assert (out.hiddens.float() - want.float()).abs().max() < 0.03 * want.float().abs().max(), mode
        target.free(state)


def test_collapsed_hidden_is_hc_head_of_the_streams():
    tokens = prompts([6], seed=7)[0]
    streams_t, collapsed_t = make_target(), make_target(mode="collapsed")
    s1, s2 = streams_t.alloc_state(), collapsed_t.alloc_state()
    a, b = streams_t.prefill(s1, tokens), collapsed_t.prefill(s2, tokens)
    assert torch.equal(a.logits, b.logits)
    w = weights(0)
    expect = torch.empty(6, CFG.hidden_size, dtype=torch.bfloat16)
    get_op("hc_head").impl(
        [a.hiddens, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"]],
        [expect],
        {"eps": CFG.rms_norm_eps, "hc_eps": CFG.hc_eps},
        None,
    )
    assert torch.equal(b.hiddens, expect)


def test_bad_input_changes_nothing():
    target = make_target(num_cache_blocks=3)
    state = target.alloc_state(budget_tokens=20)
    target.prefill(state, [1, 2, 3])
    snapshot = (list(state.table.blocks), state.length, target.cache.num_free_blocks)
    with pytest.raises(InputError, match="token"):
        target.verify([state], [[5, CFG.vocab_size]], [3])
    with pytest.raises(InputError, match="start position"):
        target.verify([state], [[5]], [2])
    with pytest.raises(InputError, match="budget"):
        target.verify([state], [[5] * 18], [3])
    with pytest.raises(InputError, match="forward states: expected a sequence with one entry per sequence, got "
                                        "TargetSeqState"):
        target.verify(state, [5], 3)  # one state, not a list of them: a TypeError from len() before
    with pytest.raises(InputError, match="forward token_lists: expected a sequence .* got str"):
        target.verify([state], "5", [3])
    # from a fuzz of the public methods: each was an AttributeError or TypeError from inside
    with pytest.raises(InputError, match="target state: expected a TargetSeqState"):
        target.prefill(3, [1])
    with pytest.raises(InputError, match="sequence 0 tokens: expected a sequence of token ids, got int"):
        target.prefill(state, 7)
    with pytest.raises(InputError, match="forward token_lists: expected a sequence .* got Tensor"):
        target.verify([state], torch.tensor(5), [3])  # a 0-d tensor: len() raised
    with pytest.raises(InputError, match=r"warm-up buckets: expected buckets of the target .* got \[3\]"):
        target.warm_up([3])
    with pytest.raises(InputError, match="capture buckets: expected a sequence of buckets"):
        target.capture(8)
    with pytest.raises(InputError, match="num_drafts: expected an int >= 1, got \\[2\\]"):
        target.device_verifier([2])
    other = target.alloc_state()
    with pytest.raises(CacheError, match="free block"):  # 1 block held, 2 free; 33 rows need 3
        target.forward([other], [list(range(33))], [0])
    assert (list(state.table.blocks), state.length, target.cache.num_free_blocks) == snapshot
    assert other.length == 0 and other.table.held() == []
    target.free(state)
    with pytest.raises(InputError, match="freed"):
        target.prefill(state, [1])
    assert target.cache.num_free_blocks == target.cache.num_blocks
