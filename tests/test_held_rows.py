"""The held-rows fast path of a propose gives what the general path gives.

Design note "held rows" (runtime.kv_cache): a batch whose ranges are all held skips ensure and
stages metadata rows it checked itself. Here ``are_held`` only says yes where ``ensure_batch``
would change nothing, the staged bytes are those of a fresh pack, and a batch that the fast path
hands back to the general one (states sharing a table, a negative kv_start, a table too long)
raises the error it always raised and changes nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from proposer_fixtures import TINY, hidden, make_proposer
from test_host_fast_paths import assert_unchanged, frozen, held_by_scan

from runtime.errors import InputError
from runtime.kv_cache import OWNED, BlockTable, PagedLatentCache
from runtime.kv_metadata import pack_metadata

B, K = 8, 2


def test_are_held_says_yes_only_where_ensure_batch_would_do_nothing():
    rng = random.Random(6)
    cache, stranger = (PagedLatentCache(8, num, window=32, max_seq_len=240) for num in (64, 4))
    seen = set()
    for _ in range(400):
        tables = [BlockTable() for _ in range(rng.randrange(1, 9))]
        firsts = []
        for table in tables:
            start, end = rng.randrange(0, 200), rng.randrange(0, 40)
            owner = stranger if rng.random() < 0.05 else cache
            if rng.random() < 0.95 and owner.can_ensure(table, start, start + end):
                owner.ensure(table, start, start + end)
                if rng.random() < 0.05 and table.held():  # a block freed behind the table's back
                    owner._state[rng.choice(table.held())] = 0
                if rng.random() < 0.03:  # a table laid out with another block size
                    table.block_size = 8
            firsts.append(rng.randrange(start, start + end + 1) if rng.random() < 0.9 else rng.randrange(-2, 240))
        k = rng.choice([1, 1, 2, 5, 17, 40])
        want = all(0 <= f and f + k - 1 < cache.max_seq_len and t.block_size == cache.block_size
                   and held_by_scan(cache, t, f, f + k - 1) for t, f in zip(tables, firsts))
        free = cache.num_free_blocks
        assert cache.are_held(tables, firsts, k) == want
        if want:  # ensure_batch agrees: nothing to add
            assert cache.ensure_batch(tables, firsts, [f + k - 1 for f in firsts]) == [[] for _ in tables]
            assert cache.num_free_blocks == free
        seen.add(want)
        for table in tables:  # back to a clean pool
            owner = stranger if table.cache_id == stranger.cache_id else cache
            for b in table.held():
                owner._state[b] = OWNED
            owner.free(table)
    assert seen == {True, False}


@pytest.fixture()
def batch():
    """A proposer and B states holding blocks, at next positions whose ranges are held (the fast path)."""
    gen = torch.Generator().manual_seed(1)
    prop = make_proposer(TINY)
    states = [prop.alloc_state() for _ in range(B)]
    hiddens = [hidden(TINY, gen) for _ in range(B)]
    positions = [36 + 32 * i for i in range(B)]  # one offset in the block: crossings come together
    prop.propose_batch(list(range(B)), hiddens, positions, 1, states)
    for state in states:
        prop.after_verify(1, state)
    return prop, states, hiddens, [p + 1 for p in positions]


def test_the_fast_path_takes_the_usual_batch_and_stages_the_bytes_of_a_fresh_pack(batch):
    prop, states, hiddens, positions = batch
    calls, inner = [], prop.cache.ensure_batch
    prop.cache.ensure_batch = lambda *args: calls.append(args) or inner(*args)
    fast = 0
    for _ in range(20):  # crossing block boundaries: new blocks come through ensure_batch
        needs_blocks = any((p + K - 1) // 16 >= len(s.table.blocks) for p, s in zip(positions, states))
        asked = len(calls)
        prop.propose_batch(list(range(B)), hiddens, positions, K, states)
        assert len(calls) - asked == needs_blocks
        fast += not needs_blocks
        rows = [(p, s.kv_start, s.table) for p, s in zip(positions, states)]
        fresh = pack_metadata(rows, prop.cache.max_blocks_per_seq, window=TINY.sliding_window)
        assert torch.equal(prop._staging_for(B).host["meta"].buf, fresh)
        for state in states:
            prop.after_verify(K, state)
        positions = [p + K for p in positions]
    assert fast > 10


def test_distinct_states_sharing_a_table_are_refused_by_ensure_batch_and_change_nothing(batch):
    prop, states, hiddens, positions = batch
    twin = prop.alloc_state()
    twin.table, twin.seq_len, twin.kv_start = states[3].table, states[3].seq_len, states[3].kv_start
    bad = states[:5] + [twin] + states[6:]
    before = frozen(prop, bad)
    with pytest.raises(InputError, match="ensure_batch tables"):
        prop.propose_batch(list(range(B)), hiddens, positions, 1, bad)
    assert_unchanged(prop, bad, before)


def test_a_held_row_that_fails_a_metadata_check_raises_as_before_and_changes_nothing(batch):
    prop, states, hiddens, positions = batch
    states[2].kv_start = states[2].seq_len = -3  # kv_start <= p <= seq_len fails: the row starts afresh at p
    prop.propose_batch(list(range(B)), hiddens, positions, 1, states)
    assert states[2].kv_start == positions[2]
    states[2].kv_start, states[2].seq_len = -3, positions[2]  # now the row keeps a kv_start < 0
    before = frozen(prop, states)
    with pytest.raises(InputError, match="metadata row 2 kv_start"):
        prop.propose_batch(list(range(B)), hiddens, positions, 1, states)
    assert_unchanged(prop, states, before)
    states[2].kv_start = 0
    states[5].table.blocks.extend([-1] * prop.cache.max_blocks_per_seq)  # held, but longer than a row holds
    before = frozen(prop, states)
    with pytest.raises(InputError, match="metadata row 5 block table"):
        prop.propose_batch(list(range(B)), hiddens, positions, 1, states)
    assert_unchanged(prop, states, before)
