"""The per-row work of a propose over flat arrays, in numpy: the twin of ``batch_kernel.c`` beside it.

Design note "flat kernel": a propose's host work is a handful of array steps over the batch's
rows (checks, the kv_start rule, the block test, the metadata and tokens, the commit). Done as
numpy ops, each costs ~1 us of dispatch whatever the batch, about 30 of them a propose: on the
lent H200 hosts, whose Python runs ~2x slower than the CI machine's, more than the whole budget
of a propose's host time. The same three steps in C take well under a microsecond each. Both
read and write only flat buffers (numpy arrays, through the buffer protocol in C), take the
same arguments and give the same results; ``tests/test_batch_kernel.py`` holds them equal on
random batches. Where the C cannot be built (no compiler, ``DRAFTGRAPH_NATIVE=0``), these run.

- :func:`bind` holds the state every call below reads: the rows' arrays (proposer/sequences.py),
  the pool's (block_state, free_stack, free_top: cache/paged_cache.py) and the sizes (vocab,
  max_seq_len, block_size, window), in :class:`Bound`'s order. The C twin keeps their buffers
  from the bind on, so a call parses only its batch's arrays; the caller binds again when an
  array is replaced (the rows grow).
- :func:`place` checks a batch (live keys, distinct, token and position ranges, budgets),
  writes each row's kv_start after the propose into ``kv_out``, and maps a block from the pool
  to every entry of positions pos .. pos + span - 1 that has none (all or nothing: when the pool
  is short, nothing). ``spans`` is int64 [1] (K, every row: a propose) or [n] (a catch-up's rows
  per sequence). It answers (status, index, m): on OK, m mapped (row, entry) pairs in
  ``mapped_out`` (the caller's undo; a ValueError, before any change, where it has no room for
  them); else the first failing check and the row it failed on (for POOL, the blocks needed),
  and the caller raises that item's typed error.
- :func:`write` writes rows 0..n-1 of a staging buffer's metadata (cache/metadata.py's layout,
  the window columns only) and tokens, and rows n .. num_live - 1 as dead rows.
- :func:`commit` writes a propose's result back (seq_len, kv_start, drafts made, verify due),
  the number of drafts each row kept into ``kept_out`` (those before the first CUT), and gives
  back every block wholly behind a row's window (its trimmed front moves on); it answers how
  many blocks went back.
- :func:`verify` is after_verify of a batch: checks (live keys, distinct, each count in
  0 .. max(drafts made, 1), a propose since the last verify), then each row's seq_len rolls back
  by the drafts it did not accept (not below kv_start), and where an entry of the dropped rows
  holds a block, every block from the new length's first whole block on goes back (the cache's
  ``truncate``). All or nothing: (status, index, blocks given back).

The batch's keys are ``serial << ROW_BITS | row`` (proposer/sequences.py): one number a state.
The pool is the cache's (block_state, free_stack, free_top: cache/paged_cache.py); the caller
holds the cache's lock around place and commit.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

OK, STALE, TWICE, TOKEN, POSITION, BUDGET, POOL, COUNT, UNPROPOSED = range(9)
CUT = -1
FREE, OWNED = 0, 1  # block states (cache/paged_cache.py)
ROW_BITS = 20
ROW_MASK = (1 << ROW_BITS) - 1
POS, SLOT, SEQ_LEN, KV_START, TABLE = 0, 8, 16, 20, 256  # byte offsets of a metadata row
SMALL_BATCH = 16  # check_keys' Python loop up to this many keys (~1 us of numpy dispatch per array op)


def check_keys(keys, rows, seq_key) -> tuple[int, int]:
    """(STALE, i) for the first key of no live row, (TWICE, i) for the first row named again, else (OK, 0)."""
    if len(keys) <= SMALL_BATCH:  # a few rows (a decode loop's catch-up checks them): no numpy dispatch
        live = len(seq_key)
        for i, (key, row) in enumerate(zip(keys.tolist(), rows.tolist())):
            if key == 0 or row >= live or seq_key[row] != key:
                return STALE, i
        seen: set[int] = set()
        for i, row in enumerate(rows.tolist()):
            if row in seen:
                return TWICE, i
            seen.add(row)
        return OK, 0
    live = (keys != 0) & (rows < len(seq_key))
    live[live] = seq_key[rows[live]] == keys[live]
    if not live.all():
        return STALE, int(np.flatnonzero(~live)[0])
    if len(keys) > 1 and len(set(rows.tolist())) != len(keys):  # a set of a batch's rows: no sort (np.unique)
        repeated = np.ones(len(keys), dtype=bool)
        repeated[np.unique(rows, return_index=True)[1]] = False  # each row's first place is no repeat
        return TWICE, int(np.flatnonzero(repeated)[0])
    return OK, 0


class Bound(NamedTuple):
    """The rows' and the pool's arrays and sizes every place / commit / verify reads (:func:`bind`)."""

    seq_key: np.ndarray
    seq_len: np.ndarray
    kv_start: np.ndarray
    max_positions: np.ndarray
    last_drafted: np.ndarray
    verify_due: np.ndarray
    tables: np.ndarray
    num_trimmed: np.ndarray
    block_state: np.ndarray
    free_stack: np.ndarray
    free_top: np.ndarray
    vocab: int
    max_seq_len: int
    block_size: int
    window: int


def bind(*args) -> Bound:
    """The state the calls below share, in :class:`Bound`'s order (the C twin holds their buffers)."""
    return Bound(*args)


def place(bound: Bound, keys, tokens, pos, spans, kv_out, mapped_out) -> tuple[int, int, int]:
    """``keys`` int64 [n]: the batch's states. See the module docstring."""
    seq_key, seq_len, kv_start, max_positions = bound.seq_key, bound.seq_len, bound.kv_start, bound.max_positions
    tables, num_trimmed, block_state = bound.tables, bound.num_trimmed, bound.block_state
    free_stack, free_top = bound.free_stack, bound.free_top
    vocab, max_seq_len, block_size = bound.vocab, bound.max_seq_len, bound.block_size
    n = len(pos)
    if len(spans) not in (1, n):
        raise ValueError(f"spans: 1 or {n} entries, got {len(spans)}")
    k = np.broadcast_to(spans, (n,))
    rows = keys & ROW_MASK
    status, index = check_keys(keys, rows, seq_key)
    if status != OK:
        return status, index, 0
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        return TOKEN, int(np.flatnonzero(bad)[0]), 0
    bad = (pos < 0) | (pos >= max_seq_len)
    if bad.any():
        return POSITION, int(np.flatnonzero(bad)[0]), 0
    bad = pos + k > max_positions[rows]
    if bad.any():
        return BUDGET, int(np.flatnonzero(bad)[0]), 0
    missing = [(int(r), j) for r, p, span in zip(rows.tolist(), pos.tolist(), k.tolist())
               for j in range(p // block_size, (p + span - 1) // block_size + 1) if tables[r, j] < 0]
    if len(missing) > free_top[0]:
        return POOL, len(missing), 0
    if 2 * len(missing) > len(mapped_out):
        raise ValueError(f"mapped_out: room for {len(mapped_out) // 2} (row, entry) pairs, {len(missing)} mapped")
    for m, (row, j) in enumerate(missing):
        free_top[0] -= 1
        block = free_stack[free_top[0]]
        tables[row, j], block_state[block] = block, OWNED
        num_trimmed[row] = min(num_trimmed[row], j)
        mapped_out[2 * m : 2 * m + 2] = row, j
    first, last = seq_len[rows], kv_start[rows]
    kv_out[:n] = np.where((last <= pos) & (pos <= first), last, pos)
    return OK, 0, len(missing)


def write(meta, row_bytes, max_blocks, columns, window, block_size, tables, rows, pos, kv, token_buf, tokens,
          num_live) -> int:
    """``rows`` int64 [n]: each batch row's table row, or its key (its low bits are the row)."""
    n, batch = len(pos), len(meta) // row_bytes
    rows = rows & ROW_MASK
    words = meta.view(np.int32).reshape(batch, row_bytes // 4)
    wide = meta.view(np.int64).reshape(batch, row_bytes // 8)
    table = words[:, TABLE // 4 : TABLE // 4 + max_blocks]
    wide[:n, POS // 8] = pos
    block = tables[rows, pos // block_size]
    wide[:n, SLOT // 8] = np.where(block >= 0, block.astype(np.int64) * block_size + pos % block_size, -1)
    words[:n, SEQ_LEN // 4] = pos + 1
    words[:n, KV_START // 4] = kv
    lo = np.clip((pos - (window - 1)) // block_size, 0, max_blocks - columns)
    cols = lo[:, None] + np.arange(columns)
    table[np.arange(n)[:, None], cols] = tables[rows[:, None], cols]
    token_buf[:n] = tokens
    if n < num_live:
        dead = slice(n, num_live)
        wide[dead, POS // 8], wide[dead, SLOT // 8], words[dead, SEQ_LEN // 4], words[dead, KV_START // 4] = 0, -1, 0, 1
        table[dead, :columns] = -1
        token_buf[dead] = 0
    return n


def commit(bound: Bound, keys, pos, kv, drafts, k, gated, kept_out) -> int:
    """A propose's rows written back; see the module docstring."""
    seq_len, kv_start, last_drafted, verify_due = bound.seq_len, bound.kv_start, bound.last_drafted, bound.verify_due
    tables, num_trimmed, window, block_size = bound.tables, bound.num_trimmed, bound.window, bound.block_size
    block_state, free_stack, free_top = bound.block_state, bound.free_stack, bound.free_top
    n, rows = len(pos), keys & ROW_MASK
    kept = (drafts != CUT).sum(axis=1) if gated else np.full(n, k)
    kept_out[:n] = kept
    seq_len[rows] = pos + kept
    kv_start[rows] = kv
    last_drafted[rows] = kept
    verify_due[rows] = True
    freed = 0
    for row, p in zip(rows.tolist(), pos.tolist()):
        stop = (p - (window - 1)) // block_size  # blocks wholly before the window of a write at p
        if stop > num_trimmed[row]:
            for j in range(int(num_trimmed[row]), min(stop, tables.shape[1])):
                block = tables[row, j]
                if block >= 0:
                    free_stack[free_top[0]], block_state[block], tables[row, j] = block, FREE, -1
                    free_top[0] += 1
                    freed += 1
            num_trimmed[row] = stop
    return freed


def verify(bound: Bound, keys, accepted) -> tuple[int, int, int]:
    """``keys``, ``accepted`` int64 [n]: the batch's states and accepted counts. See the module docstring."""
    seq_key, seq_len, kv_start, last_drafted = bound.seq_key, bound.seq_len, bound.kv_start, bound.last_drafted
    verify_due, tables, block_size = bound.verify_due, bound.tables, bound.block_size
    block_state, free_stack, free_top = bound.block_state, bound.free_stack, bound.free_top
    rows = keys & ROW_MASK
    status, index = check_keys(keys, rows, seq_key)
    if status != OK:
        return status, index, 0
    drafted = np.maximum(last_drafted[rows], 1)
    bad = (accepted < 0) | (accepted > drafted)
    if bad.any():
        return COUNT, int(np.flatnonzero(bad)[0]), 0
    if not verify_due[rows].all():
        return UNPROPOSED, int(np.flatnonzero(~verify_due[rows])[0]), 0
    freed = 0
    for row, trim in zip(rows.tolist(), (drafted - accepted).tolist()):
        verify_due[row] = False
        if trim <= 0:
            continue
        last = int(seq_len[row])
        length = max(last - trim, int(kv_start[row]))
        seq_len[row] = length
        first = -(-length // block_size)  # the first block wholly at positions >= length
        if (tables[row, first : (last - 1) // block_size + 1] >= 0).any():
            for j in range(first, tables.shape[1]):
                block = tables[row, j]
                if block >= 0:
                    free_stack[free_top[0]], block_state[block], tables[row, j] = block, FREE, -1
                    free_top[0] += 1
                    freed += 1
    return OK, 0, freed


def load():
    """The compiled twin (runtime/native/batch_kernel.c) where it builds, else this module."""
    from draftgraph.runtime.native import build

    return build.load("batch_kernel") or sys.modules[__name__]
