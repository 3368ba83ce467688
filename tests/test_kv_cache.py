"""PagedLatentCache: slots, window recycling, all-or-nothing errors, carry, threads.

The random test keeps its own model of which logical blocks each table holds (derived from
the rules in the docstrings, not from the cache's code) and checks the pool's bookkeeping
against it after every one of 10,000 operations.
"""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch
from draftgraph.runtime.cache.paged_cache import BlockTable, PagedLatentCache, TakenBlocks
from draftgraph.runtime.errors import CacheError, InputError
from draftgraph.runtime.model.config import V4Config

BS = 16


def _cache(num_blocks=16, window=128, max_seq_len=100_000, head_dim=8):
    return PagedLatentCache(head_dim, num_blocks, window=window, max_seq_len=max_seq_len)


def _snapshot(cache, *tables):
    return cache.num_free_blocks, [t.blocks.tolist() for t in tables], list(cache._state)


# ---- construction and slots ------------------------------------------------------------------


def test_shapes_from_config():
    flash = PagedLatentCache(V4Config.flash(), num_blocks=4, device="meta")
    assert flash.kv.shape == (4 * 16, 512) and flash.kv.dtype == torch.bfloat16
    assert flash.window == 128 and flash.max_blocks_per_seq == 65536 // 16 + 1
    assert flash.max_blocks_at_rest() == 9
    small = PagedLatentCache(V4Config.small(), num_blocks=3)
    assert small.kv.shape == (48, V4Config.small().cache_head_dim) and small.window == 16
    with pytest.raises(InputError, match="window= and max_seq_len="):
        PagedLatentCache(512, 4)
    with pytest.raises(InputError, match="num_blocks"):
        PagedLatentCache(V4Config.small(), 0)


def test_slot_arithmetic_and_distinct_rows():
    cache = _cache()
    a, b = BlockTable(), BlockTable()
    new_a = cache.ensure(a, 0, 40)  # blocks 0, 1, 2
    new_b = cache.ensure(b, 5, 20)  # blocks 0, 1
    assert len(new_a) == 3 and len(new_b) == 2 and cache.num_free_blocks == 11
    assert cache.ensure(a, 3, 33) == []  # already covered
    slots = {}
    for table, last in ((a, 40), (b, 20)):
        for p in range(0 if table is a else 5, last + 1):
            expected = table.blocks[p // 16] * 16 + p % 16
            assert table.slot(p) == expected
            slots[(id(table), p)] = expected
    assert len(set(slots.values())) == len(slots)  # no two positions share a kv row
    # Writing through a slot lands in exactly that row.
    cache.kv[a.slot(17)] = 1.0
    assert cache.kv.float().sum().item() == cache.head_dim
    with pytest.raises(CacheError, match="slot of position 48"):
        a.slot(48)
    with pytest.raises(InputError):
        cache.ensure(a, 10, 5)
    with pytest.raises(InputError):
        cache.ensure(a, 0, 100_000)


def test_window_recycling_over_10000_positions():
    cache = _cache(num_blocks=12, window=128)
    table = BlockTable()
    bound = math.ceil(128 / BS) + 1
    for p in range(10_000):
        cache.trim_window(table, p)
        cache.ensure(table, p, p)
        assert cache.blocks_held(table) <= bound, (p, table.held())
        # Every key the attention reads at p still has its block.
        for j in range(max(p - 127, 0) // BS, p // BS + 1):
            assert table.blocks[j] >= 0, (p, j)
    assert cache.num_free_blocks == 12 - cache.blocks_held(table)
    cache.free(table)
    assert cache.num_free_blocks == 12 and table.entries() == []


def test_a_trim_past_every_block_leaves_the_table_mapping_no_cache():
    cache, other = _cache(window=32), _cache(window=32)
    table = BlockTable()
    cache.ensure(table, 0, 47)  # 3 blocks
    first = table.blocks[0]
    assert cache.trim_windows([table], [48]) == [[first]] and table.cache_id == cache.cache_id
    released = cache.trim_window(table, 1000)  # the window starts past every block
    assert len(released) == 2 and table.held() == [] and table.cache_id == 0
    assert cache.num_free_blocks == 16 and table.num_trimmed == (1000 - 31) // BS
    other.ensure(table, 2000, 2000)  # a table that maps nothing may map another cache's blocks
    assert table.cache_id == other.cache_id and table.num_trimmed == (1000 - 31) // BS


def test_truncate_drops_only_blocks_wholly_past_length():
    cache = _cache()
    table = BlockTable()
    cache.ensure(table, 0, 63)  # 4 blocks
    assert len(cache.truncate(table, 33)) == 1  # block 2 (32..47) still holds position 32
    assert cache.blocks_held(table) == 3
    assert len(cache.truncate(table, 32)) == 1
    assert cache.blocks_held(table) == 2 and cache.num_free_blocks == 14
    assert cache.truncate(table, 1000) == []
    cache.truncate(table, 0)
    assert table.entries() == [] and cache.num_free_blocks == 16


# ---- all-or-nothing errors --------------------------------------------------------------------


def test_exhaustion_changes_nothing():
    cache = _cache(num_blocks=4)
    a, b = BlockTable(), BlockTable()
    cache.ensure(a, 0, 31)  # 2 blocks
    cache.ensure(b, 0, 0)  # 1 block
    before = _snapshot(cache, a, b)
    with pytest.raises(CacheError, match=r"expected 2 free block\(s\), got 1 free of 4"):
        cache.ensure(b, 0, 47)  # needs b's blocks 1 and 2; only one is free
    with pytest.raises(CacheError, match="free of 4"):
        cache.ensure(a, 16, 80)  # needs a's blocks 2..5
    assert _snapshot(cache, a, b) == before
    assert not cache.can_ensure(a, 16, 80) and cache.can_ensure(a, 32, 40)


def test_take_install_and_free_blocks():
    cache = _cache(num_blocks=8)
    a = BlockTable()
    cache.ensure(a, 20, 50)  # blocks 1..3
    cache.trim_window(a, 20 + 128 + 16)  # window from 37: block 1 (16..31) goes back
    slots = {p: a.slot(p) for p in range(32, 51)}
    taken = cache.take(a)
    assert isinstance(taken, TakenBlocks) and a.entries() == [] and a.is_empty
    assert cache.num_free_blocks == 8 - len(taken.block_ids)  # carried, not freed
    b = BlockTable()
    cache.install(b, taken)
    assert {p: b.slot(p) for p in slots} == slots
    # Installing the same blocks twice, or into a table that holds blocks, changes nothing.
    c = BlockTable()
    cache.ensure(c, 0, 0)
    before = _snapshot(cache, b, c)
    with pytest.raises(CacheError, match="owned by a table"):
        cache.install(BlockTable(), taken)
    with pytest.raises(CacheError, match="an empty table"):
        cache.install(c, taken)
    assert _snapshot(cache, b, c) == before
    # free_blocks: only for blocks no table owns; a second free is a double free.
    loose = cache.take(b)
    with pytest.raises(CacheError, match="owned by a table"):
        cache.free_blocks(c.held())
    cache.free_blocks(loose)
    assert cache.num_free_blocks == 7
    before = _snapshot(cache, c)
    with pytest.raises(CacheError, match="double free"):
        cache.free_blocks(loose)
    with pytest.raises(CacheError, match="double free"):
        cache.free_blocks([c.held()[0], c.held()[0]])
    with pytest.raises(CacheError, match="no such block"):
        cache.free_blocks([99])
    assert _snapshot(cache, c) == before
    with pytest.raises(CacheError, match="cache"):
        _cache().install(BlockTable(), TakenBlocks((0,), (0,), cache.cache_id))


def test_table_of_another_cache_is_refused():
    one, two = _cache(), _cache()
    table = BlockTable()
    one.ensure(table, 0, 0)
    before = _snapshot(two)
    with pytest.raises(CacheError, match="a table of cache"):
        two.ensure(table, 16, 16)
    with pytest.raises(CacheError, match="a table of cache"):  # positions it holds: no block to map, still refused
        two.ensure(table, 0, 0)
    assert _snapshot(two) == before


# ---- 10,000 random operations against a model ---------------------------------------------------


def _check_invariants(cache, tables, loose, model):
    owners: dict[int, str] = {}
    for i, table in enumerate(tables):
        for block in table.held():
            assert block not in owners, f"block {block} owned by {owners[block]} and table {i}"
            owners[block] = f"table {i}"
        held_logical = {j for j, b in enumerate(table.blocks) if b >= 0}
        assert held_logical == model[i], (i, sorted(held_logical), sorted(model[i]))
        # design note "trimmed front": the count a trim trusts is never above the truth
        assert all(b < 0 for b in table.blocks[: table.num_trimmed]), (i, table.num_trimmed, table.entries())
    for taken in loose:
        for block in taken.block_ids:
            assert block not in owners, f"loose block {block} also owned by {owners[block]}"
            owners[block] = "loose"
    free = cache._free
    assert len(set(free)) == len(free) and not set(free) & set(owners)
    assert len(free) + len(owners) == cache.num_blocks == cache.num_free_blocks + len(owners)


def test_random_operations_keep_the_pool_exact():
    rng = random.Random(1234)
    window, num_blocks = 48, 40
    cache = _cache(num_blocks=num_blocks, window=window, max_seq_len=400)
    tables = [BlockTable() for _ in range(5)]
    model: list[set[int]] = [set() for _ in tables]  # logical blocks each table holds
    loose: list[tuple[TakenBlocks, set[int]]] = []
    freed: list[TakenBlocks] = []
    failures = 0
    for _ in range(10_000):
        i = rng.randrange(len(tables))
        table, op = (
            tables[i],
            rng.choice(["ensure"] * 4 + ["trim", "truncate", "free", "take", "install", "drop"]),
        )
        before = _snapshot(cache, *tables)
        try:
            if op == "ensure":
                first = rng.randrange(400)
                last = min(399, first + rng.randrange(40))
                cache.ensure(table, first, last)
                model[i] |= set(range(first // BS, last // BS + 1))
            elif op == "trim":
                next_pos = rng.randrange(450)
                cache.trim_window(table, next_pos)
                oldest = next_pos - window + 1
                model[i] = {j for j in model[i] if (j + 1) * BS - 1 >= oldest}
            elif op == "truncate":
                length = rng.randrange(420)
                cache.truncate(table, length)
                model[i] = {j for j in model[i] if j * BS < length}
            elif op == "free":
                cache.free(table)
                model[i] = set()
            elif op == "take":
                taken = cache.take(table)
                loose.append((taken, model[i]))
                model[i] = set()
            elif op == "install" and loose:
                k = rng.randrange(len(loose))
                cache.install(table, loose[k][0])  # raises when the table holds blocks
                model[i] = loose.pop(k)[1]
            elif op == "drop" and (loose or freed):
                if freed and (not loose or rng.random() < 0.2):
                    cache.free_blocks(rng.choice(freed))  # always a double free
                    raise AssertionError("double free accepted")
                taken, _ = loose.pop(rng.randrange(len(loose)))
                cache.free_blocks(taken)
                if taken.block_ids:  # freeing an empty carry twice frees nothing: no error due
                    freed.append(taken)
        except CacheError:
            failures += 1
            assert _snapshot(cache, *tables) == before, op
        _check_invariants(cache, tables, [t for t, _ in loose], model)
    assert failures > 50  # exhaustion, double frees and refused installs were all exercised
    for table in tables:
        cache.free(table)
    for taken, _ in loose:
        cache.free_blocks(taken)
    assert cache.num_free_blocks == num_blocks


# ---- threads -------------------------------------------------------------------------------------


def test_concurrent_ensure_and_free_keep_the_count_exact():
    cache = _cache(num_blocks=64, window=64, max_seq_len=10_000)
    errors: list[BaseException] = []

    def worker(seed):
        rng = random.Random(seed)
        tables = [BlockTable() for _ in range(3)]
        try:
            for step in range(400):
                table = rng.choice(tables)
                p = rng.randrange(2000)
                try:
                    cache.ensure(table, p, p + rng.randrange(48))
                except CacheError:
                    pass  # the pool is shared and small: exhaustion is expected
                if step % 3 == 0:
                    cache.trim_window(table, p)
                if step % 7 == 0:
                    cache.free_blocks(cache.take(table))
                if step % 11 == 0:
                    cache.free(table)
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)
        finally:
            for table in tables:
                cache.free(table)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cache.num_free_blocks == 64 and sorted(cache._free) == list(range(64))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("length", [0, 1, 7, 4096, 4097])
def test_none_mapped_reads_every_entry(dtype, length):
    """The bytes compare behind truncate's and is_empty's quick answer, against numpy's, for
    every entry mapped in turn (int64 rows and rows past the compare's 4096 take numpy's)."""
    from draftgraph.runtime.cache.paged_cache import _none_mapped

    row = np.full(length, -1, dtype=dtype)
    assert _none_mapped(row)
    for j in {0, length // 2, length - 1} if length else ():
        row[j] = 0
        assert not _none_mapped(row) and not _none_mapped(row[j:]) and _none_mapped(row[j + 1 :])
        row[j] = -1


EDITS = [("a free block in the trimmed front", "free")]  # the one call that gives that entry back
EDITS += [(edit, call) for edit in ("a block mapped twice", "an id past the pool")
          for call in ("free", "truncate", "trim_window")]


@pytest.mark.parametrize("edit,call", EDITS)
def test_a_table_edited_by_hand_is_refused_before_the_pool_changes(edit, call):
    """free / truncate / trim_window give blocks back only after checking every block they give:
    a block of this pool, OWNED, mapped once. free reads the whole row, the trimmed front too
    (entries the checks before a roll-back skip as known -1)."""
    cache = _cache(num_blocks=16, window=2 * BS)
    table = cache.new_table()
    cache.ensure(table, 0, 6 * BS - 1)  # blocks 0..5 of the table
    cache.trim_window(table, 4 * BS)  # the window starts in block 2: entries 0, 1 given back, trimmed
    assert table.num_trimmed == 2 and table.held() == table.blocks[2:6].tolist()
    if edit == "a free block in the trimmed front":
        table.blocks[0] = cache._free[-1]
    elif edit == "a block mapped twice":
        table.blocks[6] = table.blocks[5]
    else:
        table.blocks[6] = cache.num_blocks + 3
    free, states, entries = cache._free, cache.block_states, table.blocks.copy()
    with pytest.raises(CacheError, match="blocks this table owns, each mapped once"):
        if call == "free":
            cache.free(table)
        elif call == "truncate":
            cache.truncate(table, 5 * BS)  # gives back entries 5 and 6
        else:
            cache.trim_window(table, 10 * BS)  # the window past every block: entries 2..6
    assert cache._free == free and cache.block_states == states and table.blocks.tolist() == entries.tolist()
