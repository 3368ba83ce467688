"""The host path of a batched propose: ensure_unheld and the rows the proposer checks itself.

Design note "held rows" (draftgraph.runtime.cache.paged_cache): a propose's ensure asks no distinct-table set and
returns undo records, [] when every row is held; the proposer then stages rows it checked as
``check_rows`` does. Here ``ensure_unheld`` equals ``ensure_batch`` (blocks, errors, pool), the
staged bytes are those of a fresh pack, and a batch the proposer's row checks refuse (states
sharing a table, a negative kv_start, a table too long) raises the error it always raised and
changes nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from draftgraph.runtime.cache.metadata import pack_metadata
from draftgraph.runtime.cache.paged_cache import BlockTable, PagedLatentCache
from draftgraph.runtime.errors import CacheError, InputError
from proposer_fixtures import TINY, accepted_batch
from test_host_fast_paths import assert_unchanged, frozen

B, K = 8, 2


def test_ensure_unheld_equals_ensure_batch_with_undo_records():
    rng = random.Random(6)
    one, two = (PagedLatentCache(8, 40, window=32, max_seq_len=240) for _ in range(2))
    ones, twos = [BlockTable() for _ in range(6)], [BlockTable() for _ in range(6)]
    firsts, seen = [0] * len(ones), set()
    for _ in range(400):
        firsts = [rng.choice([f, f + 1, f + 3, rng.randrange(-2, 240)]) for f in firsts]  # mostly on from the last
        k = rng.choice([1, 1, 2, 7, 20])
        lasts = [f + k - 1 for f in firsts]
        try:
            want = "ok", two.ensure_batch(twos, firsts, lasts)
        except (CacheError, InputError) as error:
            want = type(error), str(error)
        before = [list(t.blocks) for t in ones]
        try:
            records = one.ensure_unheld(ones, firsts, k)
            got = "ok", [next((new for i, _, new in records if i == row), []) for row in range(len(ones))]
        except (CacheError, InputError) as error:
            got, records = (type(error), str(error)), []
        assert got == want
        assert all(length == len(before[i]) and new for i, length, new in records)
        assert [t.blocks for t in ones] == [t.blocks for t in twos]
        assert one.num_free_blocks == two.num_free_blocks
        seen.add((want[0], bool(records)))
        for a, b in zip(ones, twos):
            if rng.random() < 0.3:
                at = rng.randrange(0, 240)
                one.trim_window(a, at)
                two.trim_window(b, at)
    assert {("ok", True), ("ok", False), CacheError, InputError} <= {s if s[0] == "ok" else s[0] for s in seen}


@pytest.fixture()
def batch():
    """A proposer and B states holding blocks, at next positions whose ranges are held (the fast path)."""
    positions = [36 + 32 * i for i in range(B)]  # one offset in the block: crossings come together
    return accepted_batch(positions, 1, seed=1)


def test_the_usual_step_allocates_nothing_and_stages_the_bytes_of_a_fresh_pack(batch):
    prop, states, hiddens, positions = batch
    calls, inner, inner_sink = [], prop.cache.ensure_unheld, prop.cache.ensure_sink
    prop.cache.ensure_unheld = lambda *args: calls.append(inner(*args)) or calls[-1]

    def recorded_sink():  # the compiled front's ensure (draftgraph.runtime.proposer.front), where it is built
        lock, ensure, free = inner_sink()
        return lock, ensure and (lambda *args: calls.append(ensure(*args)) or calls[-1]), free

    prop.cache.ensure_sink = recorded_sink
    fast = 0
    for _ in range(20):  # crossing block boundaries: then the rows that cross get new blocks
        needy = [i for i, (p, s) in enumerate(zip(positions, states)) if (p + K - 1) // 16 >= len(s.table.blocks)]
        calls.clear()
        prop.propose_batch(list(range(B)), hiddens, positions, K, states)
        # The one pass (draftgraph.runtime.proposer.front) asks ensure only for the rows it found unheld.
        assert [i for records in calls for i, _, _ in records] == needy
        assert len(calls) == bool(needy)
        fast += not needy
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
