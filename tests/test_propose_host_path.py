"""The host path of a propose: a table's held blocks, undo of the blocks a failed propose mapped, the batch ensure."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from draftgraph.runtime.cache.paged_cache import BlockTable
from proposer_fixtures import TINY, hidden, make_proposer


def test_held_matches_a_plain_scan():
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randrange(0, 40)
        front = rng.randrange(0, n + 1)
        blocks = [-1] * front + [rng.randrange(0, 100) for _ in range(n - front)]
        for _ in range(rng.choice([0, 0, 1, 3])):  # holes anywhere, sometimes
            if blocks:
                blocks[rng.randrange(0, len(blocks))] = -1
        table = BlockTable(np.array(blocks, dtype=np.int32))
        assert table.held() == [b for b in blocks if b >= 0]
        assert table.entries() == blocks[: max((j + 1 for j, b in enumerate(blocks) if b >= 0), default=0)]


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_a_failed_run_gives_back_every_new_block_and_changes_no_state(num_drafts):
    gen = torch.Generator().manual_seed(0)
    prop = make_proposer(TINY)
    states = [prop.alloc_state() for _ in range(3)]
    positions = [14, 40, 200]  # 14 + 3 drafts crosses into a new block
    prop.propose_batch([1, 2, 3], [hidden(TINY, gen) for _ in states], positions, 1, states)
    for state in states:
        prop.after_verify(1, state)
    before = [s.snapshot() for s in states], prop.cache.num_free_blocks
    executor = prop._executor(prop._bucket(3), num_drafts, False)

    def fail(inputs, check=True):
        raise Boom("the graph failed")

    executor.run = fail
    with pytest.raises(Boom):
        prop.propose_batch([4, 5, 6], [hidden(TINY, gen) for _ in states], [15, 41, 230], num_drafts, states)
    assert ([s.snapshot() for s in states], prop.cache.num_free_blocks) == before
    del executor.run
    drafts = prop.propose_batch([4, 5, 6], [hidden(TINY, gen) for _ in states], [15, 41, 230], num_drafts, states)
    assert len(drafts) == 3 and all(len(d) == num_drafts for d in drafts)


def test_ensure_batch_is_all_or_nothing_and_trim_windows_equals_trim_window():
    from draftgraph.runtime.cache.paged_cache import PagedLatentCache
    from draftgraph.runtime.errors import CacheError, InputError

    cache = PagedLatentCache(TINY, num_blocks=6)
    a, b = BlockTable(), BlockTable()
    assert cache.ensure_batch([a, b], [0, 40], [20, 40]) == [a.held(), b.held()]
    free = cache.num_free_blocks  # 3 left
    with pytest.raises(CacheError, match="2 sequences"):
        cache.ensure_batch([a, b], [100, 200], [140, 200])  # needs 3 + 1
    assert cache.num_free_blocks == free and len(a.entries()) == 2 and len(b.entries()) == 3
    with pytest.raises(InputError, match="distinct"):
        cache.ensure_batch([a, a], [0, 0], [1, 1])
    twin = PagedLatentCache(TINY, num_blocks=6)
    c, d = BlockTable(), BlockTable()
    twin.ensure_batch([c, d], [0, 40], [20, 40])
    released = cache.trim_windows([a, b], [40, 200])
    assert released == [twin.trim_window(c, 40), twin.trim_window(d, 200)]
    assert (a.entries(), b.entries()) == (c.entries(), d.entries())
