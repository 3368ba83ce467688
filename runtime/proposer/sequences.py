"""SequenceRows: what a proposer knows of its live sequences, one row each, in flat arrays.

A persistent batch, as vLLM's InputBatch keeps one: a sequence's drafter rows (``seq_len``,
``kv_start``), its last propose's draft count, its position budget and its block table are a
row of arrays that change in place on alloc, propose, after_verify, catch-up, carry and free.
A propose reads and writes them with array ops over the batch's rows (design note "one path"
in proposer/propose.py), never through an object per sequence.

Each row's block table is a row of ``tables`` [S, max_blocks] int32, and also a
:class:`BlockTable` viewing that row (and its ``num_trimmed`` entry: the trimmed front, design
note "trimmed front" in cache/paged_cache.py), which is what the cache's own methods edit; the
batch kernel edits the same arrays.

A row is named by its key, ``serial << ROW_BITS | row``: serials come from one counter shared
by every proposer, so a state of another proposer, or one freed (its row since reused), never
matches a live row's key, and the row is the key's low bits (one number a state, one array a
batch).
"""

from __future__ import annotations

import itertools

import numpy as np
from draftgraph.runtime.cache.paged_cache import BlockTable
from draftgraph.runtime.native.batch_kernel import ROW_BITS, ROW_MASK

_serials = itertools.count(1)


class SequenceRows:
    """Flat per-sequence arrays; grows by doubling. Not thread-safe: the proposer's lock guards it."""

    def __init__(self, max_blocks: int, block_size: int, capacity: int = 8) -> None:
        self.max_blocks, self.block_size = max_blocks, block_size
        self.seq_len = np.zeros(capacity, dtype=np.int64)  # one past the newest valid drafter row
        self.kv_start = np.zeros(capacity, dtype=np.int64)  # the first valid drafter row
        self.last_drafted = np.zeros(capacity, dtype=np.int64)  # drafts of the last propose
        self.max_positions = np.zeros(capacity, dtype=np.int64)  # positions the sequence may reach
        self.verify_due = np.zeros(capacity, dtype=bool)  # a propose since the last after_verify
        self.num_trimmed = np.zeros(capacity, dtype=np.int64)  # each table's trimmed front
        self.key = np.zeros(capacity, dtype=np.int64)  # serial << ROW_BITS | row; 0: the row is free
        self.tables = np.full((capacity, max_blocks), -1, dtype=np.int32)
        self.table_of: list[BlockTable | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return len(self.key)

    @property
    def num_live(self) -> int:
        return int(np.count_nonzero(self.key))

    def alloc(self, max_positions: int) -> int:
        """A fresh row (no drafter rows, no blocks); its key."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        key = next(_serials) << ROW_BITS | row
        self.seq_len[row] = self.kv_start[row] = self.last_drafted[row] = self.num_trimmed[row] = 0
        self.verify_due[row] = False
        self.max_positions[row], self.key[row] = max_positions, key
        self.tables[row] = -1
        self.table_of[row] = BlockTable(self.tables[row], self.block_size, self.num_trimmed[row : row + 1])
        return key

    def release(self, row: int) -> None:
        """The row goes back (its blocks are the caller's to give back first)."""
        self.key[row] = 0
        self.table_of[row] = None
        self._free.append(row)

    def reset(self, row: int) -> None:
        """No drafter rows (a take or a free of the blocks): the table is the cache's to clear."""
        self.seq_len[row] = self.kv_start[row] = self.last_drafted[row] = 0
        self.verify_due[row] = False

    def is_live(self, key: int) -> bool:
        row = key & ROW_MASK
        return key != 0 and row < len(self.key) and int(self.key[row]) == key

    def _grow(self) -> None:
        old = self.capacity
        new = max(2 * old, 8)
        if new > ROW_MASK + 1:
            raise MemoryError(f"more than {ROW_MASK + 1} live sequences in one proposer")
        for name in ("seq_len", "kv_start", "last_drafted", "max_positions", "verify_due", "num_trimmed", "key"):
            array = getattr(self, name)
            grown = np.zeros(new, dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        tables = np.full((new, self.max_blocks), -1, dtype=np.int32)
        tables[:old] = self.tables
        self.tables = tables
        for row, table in enumerate(self.table_of):  # the live tables view the new rows
            if table is not None:
                table.blocks, table.trimmed = tables[row], self.num_trimmed[row : row + 1]
        self.table_of += [None] * (new - old)
        self._free = list(range(new - 1, old - 1, -1)) + self._free
