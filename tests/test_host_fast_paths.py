"""The bulk host path of a batched propose gives what the item-by-item path gives.

Design notes "bulk checks" (runtime/proposer/checks.py) and "held rows" (runtime/cache/paged_cache.py): a batch
is checked, and its held rows skipped by ensure, in one loop over the whole batch. Here a bad
item anywhere in a batch of 32 raises the error its single-item check raises and changes no state,
and only the rows that need blocks get them, all or nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from draftgraph.runtime.cache.metadata import check_rows
from draftgraph.runtime.cache.paged_cache import OWNED, BlockTable, PagedLatentCache
from draftgraph.runtime.errors import CacheError, InputError, describe
from draftgraph.runtime.proposer.checks import (
    check_hidden,
    check_hiddens,
    check_position,
    check_positions,
    check_state,
    check_states,
    check_token,
    check_tokens,
)
from proposer_fixtures import TINY, accepted_batch, make_proposer

B, K = 32, 2
BAD_AT = (0, 17, 31)
SHAPE = (TINY.hc_mult, TINY.hidden_size)
CPU = torch.device("cpu")


@pytest.fixture()
def batch():
    """A proposer and 32 states that hold blocks, at their next positions (mid-block and on a boundary)."""
    return accepted_batch([20 + i for i in range(B)], K, seed=0)


def frozen(prop, states) -> tuple:
    return [s.snapshot() for s in states], prop.cache.num_free_blocks, prop.cache.kv.clone()


def assert_unchanged(prop, states, before) -> None:
    snaps, free, kv = before
    assert [s.snapshot() for s in states] == snaps
    assert prop.cache.num_free_blocks == free
    assert torch.equal(prop.cache.kv, kv)


def single_error(check, *args) -> str:
    """The message the single-item check raises for one bad item."""
    with pytest.raises(InputError) as info:
        check(*args)
    return str(info.value)


def other_state():
    return make_proposer(TINY).alloc_state()


def freed_state(prop):
    state = prop.alloc_state()
    prop.free_state(state)
    return state


BAD_TOKENS = [TINY.vocab_size, -1, True, "7", 3.0]
BAD_POSITIONS = [-1, 2.5, False, TINY.max_position_embeddings - 1]  # the last: past the budget with K drafts
BAD_HIDDENS = [
    torch.zeros(3, TINY.hidden_size, dtype=torch.bfloat16),
    torch.zeros(*SHAPE),
    torch.zeros(*SHAPE, dtype=torch.bfloat16, device="meta"),
    [[0.0] * TINY.hidden_size] * TINY.hc_mult,
]


def propose_with(prop, states, hiddens, positions, tokens=None):
    return prop.propose_batch(tokens or list(range(B)), hiddens, positions, K, states)


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_a_bad_token_anywhere_raises_its_own_error_and_changes_nothing(batch, at, bad):
    prop, states, hiddens, positions = batch
    tokens = list(range(B))
    tokens[at] = bad
    before = frozen(prop, states)
    with pytest.raises(InputError) as info:
        propose_with(prop, states, hiddens, positions, tokens)
    assert str(info.value) == single_error(check_token, bad, TINY.vocab_size)
    assert_unchanged(prop, states, before)


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("bad", BAD_POSITIONS, ids=repr)
def test_a_bad_position_anywhere_raises_its_own_error_and_changes_nothing(batch, at, bad):
    prop, states, hiddens, positions = batch
    positions[at] = bad
    before = frozen(prop, states)
    with pytest.raises(InputError) as info:
        propose_with(prop, states, hiddens, positions)
    assert str(info.value) == single_error(check_position, bad, K, states[at])
    assert_unchanged(prop, states, before)


@pytest.mark.parametrize("at", BAD_AT)
def test_a_position_past_one_states_budget_is_refused_for_that_state_only(batch, at):
    prop, states, hiddens, positions = batch
    states[at] = prop.alloc_state_for(positions[at] + K - 1)  # one position short
    before = frozen(prop, states)
    with pytest.raises(InputError, match="budget") as info:
        propose_with(prop, states, hiddens, positions)
    assert str(info.value) == single_error(check_position, positions[at], K, states[at])
    assert_unchanged(prop, states, before)


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("case", range(len(BAD_HIDDENS)), ids=["shape", "dtype", "device", "not a tensor"])
def test_a_bad_hidden_anywhere_raises_its_own_error_and_changes_nothing(batch, at, case):
    prop, states, hiddens, positions = batch
    hiddens = list(hiddens)
    hiddens[at] = BAD_HIDDENS[case]
    before = frozen(prop, states)
    with pytest.raises(InputError) as info:
        propose_with(prop, states, hiddens, positions)
    assert str(info.value) == single_error(check_hidden, BAD_HIDDENS[case], SHAPE, CPU)
    assert_unchanged(prop, states, before)


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("kind", ["freed", "foreign", "not a state"])
def test_a_bad_state_anywhere_raises_its_own_error_and_changes_nothing(batch, at, kind):
    prop, states, hiddens, positions = batch
    bad = {"freed": freed_state, "foreign": lambda _: other_state(), "not a state": lambda _: object()}[kind](prop)
    before = frozen(prop, states)
    with pytest.raises(InputError) as info:
        propose_with(prop, states[:at] + [bad] + states[at + 1 :], hiddens, positions)
    assert str(info.value) == single_error(check_state, bad, prop.id)
    assert_unchanged(prop, states, before)


@pytest.mark.parametrize("at", BAD_AT)
def test_a_duplicate_state_anywhere_is_refused_and_changes_nothing(batch, at):
    prop, states, hiddens, positions = batch
    twin = (at + 5) % B
    before = frozen(prop, states)
    with pytest.raises(InputError) as info:
        propose_with(prop, states[:at] + [states[twin]] + states[at + 1 :], hiddens, positions)
    assert str(info.value) == describe("states", "distinct states", "the same state twice")
    assert_unchanged(prop, states, before)


def test_the_first_kind_of_check_that_fails_names_the_error(batch):
    """States, then tokens, then positions, then hiddens, as item by item."""
    prop, states, hiddens, positions = batch
    bad_hiddens = list(hiddens)
    bad_hiddens[0] = BAD_HIDDENS[1]
    bad_positions = list(positions)
    bad_positions[31] = -1
    with pytest.raises(InputError, match="last_token"):
        propose_with(prop, states, bad_hiddens, bad_positions, [0] * 31 + [-1])
    with pytest.raises(InputError, match="position"):
        propose_with(prop, states, bad_hiddens, bad_positions)
    with pytest.raises(InputError, match="another proposer"):
        propose_with(prop, states[:31] + [other_state()], bad_hiddens, bad_positions, [-1] * 32)


def test_items_the_bulk_pass_leaves_to_the_single_checks_still_work(batch):
    """A one-element tensor token, a [1, C, D] hidden: item by item, and the same drafts."""
    prop, states, hiddens, positions = batch
    twin = make_proposer(TINY)
    twin_states = [twin.alloc_state() for _ in range(B)]
    twin.propose_batch(list(range(B)), hiddens, [p - K for p in positions], K, twin_states)
    for state in twin_states:
        twin.after_verify(K, state)
    tokens = list(range(B))
    odd_tokens, odd_hiddens = list(tokens), list(hiddens)
    odd_tokens[17] = torch.tensor(17)
    odd_hiddens[31] = hiddens[31].unsqueeze(0)
    assert propose_with(prop, states, odd_hiddens, positions, odd_tokens) == propose_with(
        twin, twin_states, hiddens, positions, tokens)
    assert [s.snapshot() for s in states] == [s.snapshot() for s in twin_states]


# ---- ensure: only the rows that need blocks ---------------------------------------------------


def recording_ensure_unheld(prop, states) -> list:
    """Wrap the batch ensure: each call appends (the states' tables before, undo records, tables after).

    Both ways a propose ensures its unheld rows: ``cache.ensure_unheld``, and the compiled
    front's ensure (``cache.ensure_sink``, draftgraph.runtime.proposer.front) where that is built.
    """
    calls, inner, inner_sink = [], prop.cache.ensure_unheld, prop.cache.ensure_sink

    def recorded(ensure):
        def call(*args):
            before = [list(s.table.blocks) for s in states]
            records = ensure(*args)
            calls.append((before, records, [list(s.table.blocks) for s in states]))
            return records
        return call

    def ensure_sink():
        lock, ensure, free = inner_sink()
        return lock, ensure and recorded(ensure), free

    prop.cache.ensure_unheld = recorded(inner)
    prop.cache.ensure_sink = ensure_sink
    return calls


def test_only_the_rows_that_need_blocks_get_them(batch):
    prop, states, hiddens, positions = batch
    calls = recording_ensure_unheld(prop, states)
    needy = [i for i, p in enumerate(positions) if (p + K - 1) // 16 >= len(states[i].table.blocks)]
    assert 0 < len(needy) < B  # the batch mixes both
    propose_with(prop, states, hiddens, positions)
    (before, records, after), = calls
    added = {i: new for i, _, new in records}
    assert sorted(added) == needy
    assert all(length == len(before[i]) for i, length, _ in records)
    for i in range(B):
        if i in needy:
            assert [b for b in after[i] if b >= 0] == [b for b in before[i] if b >= 0] + added[i]
        else:
            assert after[i] == before[i]


def test_a_failed_run_gives_back_exactly_the_blocks_of_the_rows_that_got_them(batch):
    prop, states, hiddens, positions = batch
    executor = prop._executor(prop._bucket(B), K, False)

    def fail(inputs, check=True):
        raise RuntimeError("the graph failed")

    executor.run = fail
    before = frozen(prop, states)
    with pytest.raises(RuntimeError, match="graph failed"):
        propose_with(prop, states, hiddens, positions)
    assert_unchanged(prop, states, before)
    del executor.run
    propose_with(prop, states, hiddens, positions)


def test_a_pool_too_small_for_the_rows_that_need_blocks_changes_nothing(batch):
    prop, states, hiddens, positions = batch
    needy = [i for i, p in enumerate(positions) if (p + K - 1) // 16 >= len(states[i].table.blocks)]
    while prop.cache.num_free_blocks > len(needy) - 1:  # one block short
        prop.cache.ensure(BlockTable(), 0, 0)
    before = frozen(prop, states)
    with pytest.raises(CacheError) as info:
        propose_with(prop, states, hiddens, positions)
    assert str(info.value) == describe(
        f"MTP cache blocks for {B} sequences", f"{len(needy)} free block(s)",
        f"{len(needy) - 1} free of {prop.cache.num_blocks}",
        "free finished sequences, call trim_window, or size the pool larger")
    assert_unchanged(prop, states, before)


def held_by_scan(cache, table, first_pos, last_pos) -> bool:
    """The oracle of design note "held rows", entry by entry."""
    first, last = first_pos // cache.block_size, last_pos // cache.block_size
    if last - first > 1 or table.cache_id != cache.cache_id:
        return False
    entries = table.blocks[first : last + 1]
    return len(entries) == last - first + 1 and all(
        0 <= b < cache.num_blocks and cache._state[b] == OWNED for b in entries)


def test_unheld_rows_equals_an_entry_by_entry_scan():
    rng = random.Random(5)
    cache, stranger = (PagedLatentCache(8, num, window=32, max_seq_len=2000) for num in (64, 4))
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
            firsts.append(rng.randrange(start, start + end + 1) if rng.random() < 0.9 else rng.randrange(0, 240))
        lasts = list(firsts) if rng.random() < 0.5 else [f + rng.choice([0, 0, 1, 5, 15, 16, 40]) for f in firsts]
        want = [i for i, t in enumerate(tables) if not held_by_scan(cache, t, firsts[i], lasts[i])]
        assert cache._unheld_rows(tables, firsts, lasts) == want
        for table in tables:  # back to a clean pool
            owner = stranger if table.cache_id == stranger.cache_id else cache
            for b in table.held():
                owner._state[b] = OWNED  # undo the frees behind the table's back
            owner.free(table)
        assert cache.num_free_blocks == cache.num_blocks and stranger.num_free_blocks == stranger.num_blocks


def test_ensure_batch_equals_ensure_one_by_one():
    rng = random.Random(9)
    one, two = (PagedLatentCache(8, 40, window=32, max_seq_len=2000) for _ in range(2))
    ones, twos = [BlockTable() for _ in range(6)], [BlockTable() for _ in range(6)]
    firsts = [0] * len(ones)
    for _ in range(400):
        firsts = [rng.choice([f, f + 1, f + 3, rng.randrange(0, 300)]) for f in firsts]  # mostly on from the last
        lasts = [f + rng.choice([0, 0, 1, 7, 20]) for f in firsts]
        needed = sum(one.blocks_needed(t, f, last) for t, f, last in zip(ones, firsts, lasts))
        if needed > one.num_free_blocks:
            before = (one.num_free_blocks, [list(t.blocks) for t in ones])
            with pytest.raises(CacheError, match="6 sequences"):
                one.ensure_batch(ones, firsts, lasts)
            assert (one.num_free_blocks, [list(t.blocks) for t in ones]) == before
        else:
            added = one.ensure_batch(ones, firsts, lasts)
            assert added == [two.ensure(t, f, last) for t, f, last in zip(twos, firsts, lasts)]
        assert [t.blocks for t in ones] == [t.blocks for t in twos]
        assert one.num_free_blocks == two.num_free_blocks
        for a, b in zip(ones, twos):
            if rng.random() < 0.3:
                at = rng.randrange(0, 400)
                one.trim_window(a, at)
                two.trim_window(b, at)


def test_a_held_range_of_a_table_of_another_cache_is_still_refused():
    one, two = (PagedLatentCache(8, 8, window=32, max_seq_len=2000) for _ in range(2))
    table, mine = BlockTable(), BlockTable()
    one.ensure(table, 0, 0)
    two.ensure(mine, 0, 0)
    for call in (lambda: two.ensure(table, 0, 0), lambda: two.ensure_batch([mine, table], [0, 0], [0, 0])):
        with pytest.raises(CacheError, match="a table of cache"):
            call()
    assert two.num_free_blocks == 7


# ---- the bulk checks against the single-item checks, on random batches ------------------------------


def outcome(check, *args):
    try:
        return "ok", check(*args)
    except InputError as error:
        return "error", str(error)


def one_by_one(check, items, *args) -> list:
    return [check(item, *args) for item in items]


def positions_one_by_one(positions, num_drafts, states) -> list:
    return [check_position(p, num_drafts, s) for p, s in zip(positions, states)]


def sprinkled(rng, n, good, bad) -> list:
    """``n`` items from ``good()``, each one replaced by a pick from ``bad`` one time in ten."""
    return [rng.choice(bad) if rng.random() < 0.1 else good() for _ in range(n)]


def test_bulk_checks_equal_the_single_item_checks():
    rng = random.Random(2)
    prop = make_proposer(TINY)
    live = [prop.alloc_state_for(rng.choice([None, 40])) for _ in range(8)]
    odd = [freed_state(prop), other_state(), object()]
    good_hidden = torch.zeros(*SHAPE, dtype=torch.bfloat16)
    for _ in range(400):
        n = rng.randrange(1, 9)
        states = sprinkled(rng, n, lambda: rng.choice(live), odd)
        tokens = sprinkled(rng, n, lambda: rng.randrange(TINY.vocab_size), BAD_TOKENS + [torch.tensor(3)])
        positions = sprinkled(rng, n, lambda: rng.randrange(0, 45), BAD_POSITIONS)
        hiddens = sprinkled(rng, n, lambda: good_hidden, BAD_HIDDENS + [good_hidden.unsqueeze(0)])
        live_states = [rng.choice(live) for _ in range(n)]
        assert outcome(check_states, states, prop.id) == outcome(one_by_one, check_state, states, prop.id)
        assert outcome(check_tokens, tokens, TINY.vocab_size) == outcome(one_by_one, check_token, tokens,
                                                                         TINY.vocab_size)
        assert outcome(check_positions, positions, K, live_states) == outcome(positions_one_by_one, positions, K,
                                                                              live_states)
        got, want = outcome(check_hiddens, hiddens, SHAPE, CPU), outcome(one_by_one, check_hidden, hiddens, SHAPE,
                                                                         CPU)
        if want[0] == "error":
            assert got == want
        else:
            assert got[0] == "ok" and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got[1], want[1]))


@pytest.mark.parametrize("at", BAD_AT)
def test_check_rows_names_the_bad_row(at):
    table = BlockTable(blocks=[-1, 3, 4], block_size=16)
    good = (20, 16, table)
    for bad, error, match in (((20, 21, table), InputError, f"metadata row {at} kv_start"),
                              ((20, 0, [1] * 9), InputError, f"metadata row {at} block table"),
                              ((5, 0, table), CacheError, f"metadata row {at} position 5")):
        rows = [good] * B
        rows[at] = bad
        with pytest.raises(error, match=match):
            check_rows(rows, 8)
    assert check_rows([good, None, (33, 0, [7, 8, 9])], 8) == [(20, 16, table.blocks, 16), None,
                                                              (33, 0, [7, 8, 9], 16)]
