"""The proposer's API: propose vs the reference over rounds, batching, carry, confidence."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from proposer_fixtures import SMALL, TINY, hidden, make_proposer
from reference_v4 import ReferenceMtp

GAP = 0.06


def test_propose_matches_reference_over_rounds_with_after_verify_and_catchup():
    tensors = random_mtp_weights(SMALL, seed=5)
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

    prop = DeepseekV4MtpProposer(SMALL, tensors, executor="eager")
    ref = ReferenceMtp(SMALL, tensors)
    gen = torch.Generator().manual_seed(1)
    state = prop.alloc_state()
    prompt = torch.randint(SMALL.vocab_size, (5,), generator=gen).tolist()
    hs = hidden(SMALL, gen, n=5)
    prop.prefill_drafter(prompt, hs, state)
    for i in range(4):
        ref.step(prompt[i + 1], hs[i].double(), i)
    position, token, h = 4, 7, hs[-1]
    checked = 0
    for round_index in range(4):
        drafts = prop.propose(token, h, position, 3, state)
        rh = h.double()
        for k in range(3):
            logits, rh = ref.step(token if k == 0 else drafts[k - 1], rh, position + k)
            top = torch.topk(logits, 2)
            assert float(top.values[0] - logits[drafts[k]]) <= GAP
            if float(top.values[0] - top.values[1]) > GAP:
                assert drafts[k] == int(top.indices[0])
                checked += 1
        accepted = round_index % 3  # 0, 1, 2, 0 accepted drafts
        prop.after_verify(accepted, state)
        assert state.seq_len == position + accepted
        new = hidden(SMALL, gen, n=accepted + 1)
        pair_h = torch.cat([h.unsqueeze(0), new[:accepted]])
        assert prop.catchup_drafter([token, *drafts[:accepted]], pair_h, position, position, state) == accepted + 1
        for j, (tok, hh) in enumerate(zip([token, *drafts[:accepted]], pair_h)):
            ref.step(tok, hh.double(), position + j)  # the reference's rows follow the same pairs
        assert prop.drafter_rows(state) == position + accepted + 1
        assert prop.last_pair_key(state) == position + accepted
        position, token, h = position + accepted + 1, int(drafts[-1]), new[-1]
    assert checked >= 3
    prop.free_state(state)
    assert prop.cache.num_free_blocks == prop.cache.num_blocks


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_propose_batch_equals_separate_proposes(mode):
    gen = torch.Generator().manual_seed(2)
    a, b = make_proposer(TINY, seed=1, mode=mode), make_proposer(TINY, seed=1, mode=mode)
    n = 3
    prompts = [torch.randint(TINY.vocab_size, (length,), generator=gen).tolist() for length in (3, 9, 20)]
    hs = [hidden(TINY, gen, mode, len(p)) for p in prompts]
    states_a, states_b = [a.alloc_state() for _ in range(n)], [b.alloc_state() for _ in range(n)]
    for p, h, sa, sb in zip(prompts, hs, states_a, states_b):
        a.prefill_drafter(p, h, sa)
        b.prefill_drafter(p, h, sb)
    tokens = [5, 17, 42]
    positions = [len(p) - 1 for p in prompts]
    last_h = [h[-1] for h in hs]
    for _ in range(3):
        conf = []
        batched = a.propose_batch(tokens, last_h, positions, 2, states_a, out_conf=conf)
        single = [b.propose(t, h, p, 2, s) for t, h, p, s in zip(tokens, last_h, positions, states_b)]
        assert batched == single
        assert len(conf) == n and all(len(c) == 2 and all(0 < x <= 1 for x in c) for c in conf)
        for i in range(n):
            a.after_verify(1, states_a[i])
            b.after_verify(1, states_b[i])
        tokens = [d[0] for d in batched]
        positions = [p + 1 for p in positions]
        last_h = [hidden(TINY, gen, mode) for _ in range(n)]
        for i in range(n):  # catch up the exact row of position p - 1 on both
            for prop, states in ((a, states_a), (b, states_b)):
                prop.catchup_drafter([tokens[i]], last_h[i].unsqueeze(0), positions[i] - 1, positions[i] - 1,
                                     states[i])


def test_take_install_carries_the_drafter_kv():
    gen = torch.Generator().manual_seed(3)
    prop = make_proposer(TINY, seed=2)
    state = prop.alloc_state()
    prop.prefill_drafter(list(range(10)), hidden(TINY, gen, n=10), state)
    h = hidden(TINY, gen)
    before = prop.propose(3, h, 9, 2, state)
    prop.after_verify(2, state)
    rows, key = prop.drafter_rows(state), prop.last_pair_key(state)
    carried = prop.take_drafter_kv(state)
    blocks, carried_rows, carried_key = carried
    assert (carried_rows, carried_key) == (11, 10) and (rows, key) == (11, 10)
    assert prop.drafter_rows(state) == 0 and prop.last_pair_key(state) is None and state.table.is_empty
    prop.free_state(state)  # frees nothing: the blocks were carried out
    assert prop.cache.num_free_blocks == prop.cache.num_blocks - len([b for b in blocks if b >= 0])
    fresh = prop.alloc_state()
    assert prop.install_drafter_kv(fresh, carried, carried_rows, carried_key)
    assert prop.drafter_rows(fresh) == rows and prop.last_pair_key(fresh) == key
    again = prop.propose(3, h, 9, 2, fresh)  # same rows before position 9 -> same drafts
    assert again == before
    prop.free_state(fresh)
    assert prop.cache.num_free_blocks == prop.cache.num_blocks
    other = prop.alloc_state()
    prop.prefill_drafter(list(range(4)), hidden(TINY, gen, n=4), other)
    dropped = prop.take_drafter_kv(other)
    prop.free_drafter_kv(dropped)
    prop.free_state(other)
    assert prop.cache.num_free_blocks == prop.cache.num_blocks


def test_confidence_and_small_queries():
    gen = torch.Generator().manual_seed(4)
    prop = make_proposer(TINY, draft_conf_tau=0.5)
    state = prop.alloc_state()
    prop.propose(1, hidden(TINY, gen), 0, 3, state)
    conf = prop.last_confidence()
    assert conf is not None and 0 < conf <= 1
    plain = make_proposer(TINY)
    s2 = plain.alloc_state()
    plain.propose(1, hidden(TINY, gen), 0, 1, s2)
    assert plain.last_confidence() is None
    assert prop.block_gamma() is None and prop.needs_comm() is False
    assert prop.prefill_uses_shared_buffers() is False
    assert prop.propose_batch_max() == 64
    assert prop.prefill_hidden_rows(100) == 100


def test_deferred_draft_embedding():
    gen = torch.Generator().manual_seed(6)
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    target = torch.full((TINY.hidden_size,), float("nan"), dtype=torch.bfloat16)
    drafts = prop.propose(2, hidden(TINY, gen), 0, 2, state, draft_embed_target=target)
    assert prop.read_deferred_draft_token() == drafts[-1]
    assert torch.equal(target, prop.weights["embed.weight"][drafts[-1]])


def test_grammar_mask_allowing_nothing_warns_and_drafts_zero():
    gen = torch.Generator().manual_seed(7)
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    words = (TINY.vocab_size + 31) // 32
    with pytest.warns(UserWarning, match="allows no token"):
        drafts = prop.propose(2, hidden(TINY, gen), 0, 2, state, grammar_bitmask=[0] * words)
    assert drafts == [0, 0]
    only = [0] * words
    only[1] = 1 << 3  # token 35
    assert prop.propose(2, hidden(TINY, gen), 0, 2, state, grammar_bitmask=only) == [35, 35]
