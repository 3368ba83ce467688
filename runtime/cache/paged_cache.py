"""PagedLatentCache: the MTP attention's own paged latent cache (never the target's).

MLA-shaped, as in the seed: one KV head, rows of ``cache_head_dim`` (kv_lora_rank +
qk_rope_head_dim = 512 for V4-Flash) in bf16, blocks of 16 positions. Storage is one tensor
``kv`` [num_blocks * block_size, head_dim]; the slot of position p of a sequence is
``table[p // 16] * 16 + p % 16``.

A sequence's :class:`BlockTable` is one flat int32 row (-1 where no block is mapped), so a
caller that keeps many sequences (the proposer's persistent batch) holds their tables as rows
of one 2-D array and reads them with array ops; the cache only ever edits the entries it maps
or gives back.

Block ownership (design note "block states"): every physical block is in exactly one state,

    FREE  --ensure-->  OWNED (by one BlockTable)  --take-->  LOOSE (carried by the caller)
      ^                    |  trim / truncate / free            |  install --> OWNED
      +--------------------+------------------------------------+  free_blocks --> FREE

and every transition is checked, so a double free, freeing a block a table still maps, or
installing a block twice raises :class:`CacheError`. Every operation validates first and
mutates after, under one lock: on any error nothing changes, neither a table nor the pool.

The pool is flat arrays too (``block_state`` int8 per block, ``free_stack`` int32 with its
height in ``free_top``), so that a proposer's batch kernel maps and gives back its rows' blocks
in place, under :attr:`lock` (runtime/native/batch_kernel.py), with the same rules.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from draftgraph.runtime.cache.metadata import max_blocks_for
from draftgraph.runtime.errors import CacheError, InputError, describe
from draftgraph.runtime.model.config import V4Config

__all__ = ["BLOCK_SIZE", "BlockTable", "PagedLatentCache", "TakenBlocks"]

BLOCK_SIZE = 16  # positions a block, the seed's (and the proposer's cache)

FREE, OWNED, LOOSE = 0, 1, 2
_STATE_NAMES = {FREE: "free", OWNED: "owned by a table", LOOSE: "taken (owned by no table)"}
_cache_ids = itertools.count(1)
_UNMAPPED = b"\xff" * (4 * 4096)  # int32 -1 entries as bytes: a table row of up to 4096 entries
_OWNED_RUN = bytes([OWNED]) * 4096  # int8 OWNED states as bytes: the held blocks of a table checked at once


def _none_mapped(entries: np.ndarray) -> bool:
    """Whether every entry of an int32 table row is -1.

    One bytes compare (about 0.3 us) in place of numpy's ``(row >= 0).any()`` (about 2 us): a
    decode loop rolls back every sequence every step, and most roll-backs give nothing back.
    """
    if entries.dtype == np.int32 and entries.nbytes <= len(_UNMAPPED):
        return entries.tobytes() == _UNMAPPED[: entries.nbytes]
    return not bool((entries >= 0).any())


class BlockTable:
    """One sequence's map from logical block ``p // block_size`` to a physical block id.

    ``blocks`` is an int32 row, -1 where no block is mapped (never allocated, or given back:
    window, rollback). An empty table (``BlockTable()``) gets its row at the first ensure; a
    table may also be a view of a row of a caller's 2-D array (the proposer's persistent
    batch). Only :class:`PagedLatentCache` writes it.
    """

    __slots__ = ("blocks", "block_size", "cache_id", "trimmed")

    def __init__(self, blocks: np.ndarray | None = None, block_size: int = BLOCK_SIZE,
                 trimmed: np.ndarray | None = None) -> None:
        self.blocks = np.empty(0, dtype=np.int32) if blocks is None else blocks
        self.block_size = block_size
        self.cache_id = 0  # the cache whose blocks it maps; 0 while it maps none
        # int64 [1]: entries below it are -1 (design note "trimmed front"); a view of a persistent
        # batch's column for its tables, so that the batch kernel reads and moves it too.
        self.trimmed = np.zeros(1, dtype=np.int64) if trimmed is None else trimmed

    @property
    def num_trimmed(self) -> int:
        return int(self.trimmed[0])

    @num_trimmed.setter
    def num_trimmed(self, value: int) -> None:
        self.trimmed[0] = value

    def block_of(self, pos: int) -> int:
        """Physical block id of position ``pos``, or -1."""
        j = pos // self.block_size
        return int(self.blocks[j]) if 0 <= j < len(self.blocks) else -1

    def slot(self, pos: int) -> int:
        """Row of ``kv`` that holds position ``pos``; CacheError when no block covers it."""
        block = self.block_of(pos) if pos >= 0 else -1
        if block < 0:
            raise CacheError(describe(f"slot of position {pos}", "a position with an allocated block",
                                      f"no block (table {self.entries()})", "call cache.ensure() first"))
        return block * self.block_size + pos % self.block_size

    def held(self) -> list[int]:
        """Physical ids this table maps, in logical order."""
        return self.held_ids().tolist()

    def held_ids(self) -> np.ndarray:
        """:meth:`held` as the row's int32 entries (no list made: the cache's checks read them)."""
        row = self.blocks[self.trimmed[0] :]
        return row[row >= 0]

    def entries(self) -> list[int]:
        """The logical map up to its last mapped entry (-1 where none): what a take carries."""
        mapped = np.flatnonzero(self.blocks >= 0)
        return self.blocks[: mapped[-1] + 1].tolist() if len(mapped) else []

    @property
    def is_empty(self) -> bool:
        return _none_mapped(self.blocks[self.num_trimmed :])

    def __repr__(self) -> str:
        return f"BlockTable({self.entries()}, block_size={self.block_size})"


class TakenBlocks(NamedTuple):
    """Blocks carried out of a table by :meth:`PagedLatentCache.take`: the logical map and the ids."""

    blocks: tuple[int, ...]  # logical map, -1 where the table had none
    block_ids: tuple[int, ...]  # the physical blocks, now LOOSE
    cache_id: int
    serial: int = 0  # which take() made it: a stale copy cannot free or install re-taken blocks


class PagedLatentCache:
    """A pool of latent-cache blocks shared by the sequences of one MTP proposer.

    Parameters
    ----------
    config_or_head_dim : a V4Config (head_dim = ``cache_head_dim``, window and max length from
        it) or the row width as an int (then pass ``window`` and ``max_seq_len``).
    num_blocks : pool size, chosen by the caller (e.g. batch * (ceil(window / 16) + 1 + K)).
    block_size : positions per block (16 in the seed).
    window : sliding-window length; blocks wholly before it are recycled by ``trim_window``.
    max_seq_len : positions allowed are 0 .. max_seq_len - 1.

    Example
    -------
    >>> cache = PagedLatentCache(V4Config.small(), num_blocks=8)
    >>> table = BlockTable()
    >>> cache.ensure(table, 0, 20)
    [7, 6]
    >>> table.slot(17)
    97
    """

    def __init__(
        self,
        config_or_head_dim: V4Config | int,
        num_blocks: int,
        *,
        block_size: int = BLOCK_SIZE,
        window: int | None = None,
        max_seq_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if isinstance(config_or_head_dim, V4Config):
            head_dim = config_or_head_dim.cache_head_dim
            window = config_or_head_dim.sliding_window if window is None else window
            if max_seq_len is None:
                max_seq_len = config_or_head_dim.max_position_embeddings
        else:
            head_dim = int(config_or_head_dim)
            if window is None or max_seq_len is None:
                raise InputError(describe("PagedLatentCache(head_dim, ...)", "window= and max_seq_len=",
                                          f"window={window}, max_seq_len={max_seq_len}",
                                          "or pass a V4Config, which has both"))
        for what, value in (("num_blocks", num_blocks), ("block_size", block_size), ("window", window),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(describe(what, "an int >= 1", value))
        self.head_dim, self.block_size, self.window, self.max_seq_len = head_dim, block_size, window, max_seq_len
        self._width = max_blocks_for(max_seq_len, block_size)  # read on every check of a table
        self.cache_id = next(_cache_ids)
        try:
            self.kv = torch.zeros(num_blocks * block_size, head_dim, dtype=dtype, device=device)  # [P*16, d]
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            size = num_blocks * block_size * head_dim * torch.empty((), dtype=dtype).element_size()
            raise CacheError(describe("num_blocks", f"a cache that fits in {torch.device(device)} memory",
                                      f"{num_blocks} blocks ({size / 2**30:.1f} GiB)",
                                      f"fewer blocks ({type(e).__name__} on allocation)")) from None
        self._lock = threading.Lock()
        self._state = np.zeros(num_blocks, dtype=np.int8)  # FREE / OWNED / LOOSE per block
        self._taken_by: dict[int, int] = {}  # LOOSE block -> serial of the take() that loosed it
        self._serials = itertools.count(1)
        # A stack: the most recently freed block is reused first (its rows are likely cached).
        self.free_stack = np.arange(num_blocks, dtype=np.int32)
        self.free_top = np.array([num_blocks], dtype=np.int64)  # the stack's height

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._state)

    @property
    def lock(self) -> threading.Lock:
        """The pool's lock: held by every change of a table or the pool, the batch kernel's too."""
        return self._lock

    @property
    def block_states(self) -> list[int]:
        """FREE / OWNED / LOOSE per physical block (a copy)."""
        with self._lock:
            return self._state.tolist()

    @property
    def block_state(self) -> np.ndarray:
        """FREE / OWNED / LOOSE per physical block: the pool's own array (for the batch kernel)."""
        return self._state

    @property
    def _free(self) -> list[int]:
        """The free blocks, bottom of the stack first (a copy)."""
        return self.free_stack[: self.free_top[0]].tolist()

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return int(self.free_top[0])

    @property
    def max_blocks_per_seq(self) -> int:
        """Entries of a block table: ceil(max_seq_len / block_size) + 1."""
        return self._width

    def new_table(self) -> BlockTable:
        """An empty table of this cache's width."""
        return BlockTable(np.full(self.max_blocks_per_seq, -1, dtype=np.int32), self.block_size)

    def blocks_held(self, table: BlockTable) -> int:
        return len(table.held())

    def max_blocks_at_rest(self) -> int:
        """Blocks a sequence holds after ``trim_window`` + ``ensure`` of one position."""
        return math.ceil(self.window / self.block_size) + 1

    def blocks_needed(self, table: BlockTable, first_pos: int, last_pos: int) -> int:
        """How many new blocks ``ensure(table, first_pos, last_pos)`` would take from the pool."""
        self._check_range(first_pos, last_pos)
        return len(self._missing(table, first_pos, last_pos))

    def can_ensure(self, table: BlockTable, first_pos: int, last_pos: int) -> bool:
        with self._lock:
            return self.blocks_needed(table, first_pos, last_pos) <= self.free_top[0]

    # ---- mutations (validate, then mutate, under the lock) -----------------------------------
    def ensure(self, table: BlockTable, first_pos: int, last_pos: int) -> list[int]:
        """Give positions ``first_pos..last_pos`` (inclusive) slots; returns the new block ids.

        Raises CacheError (pool exhausted, with needed / free counts) and changes nothing when
        the pool cannot supply every block the range needs.
        """
        return self.ensure_batch([table], [first_pos], [last_pos], f"positions {first_pos}..{last_pos}")[0]

    def ensure_batch(self, tables: Sequence[BlockTable], first_positions: Sequence[int],
                     last_positions: Sequence[int], what: str | None = None) -> list[list[int]]:
        """``ensure`` for several distinct tables under one lock, all or nothing; the new ids per table."""
        if len({id(t) for t in tables}) != len(tables):
            raise InputError(describe("ensure_batch tables", "distinct tables", "the same table twice"))
        for first_pos, last_pos in zip(first_positions, last_positions):
            self._check_range(first_pos, last_pos)
        bs, ours = self.block_size, (0, self.cache_id)
        with self._lock:
            missing, needed = [], 0
            for table, first_pos, last_pos in zip(tables, first_positions, last_positions):
                blocks, j0, j1 = table.blocks, first_pos // bs, last_pos // bs
                # The usual range (a verify's rows): inside one or two blocks the table holds.
                if j1 - j0 < 2 and j1 < len(blocks) and blocks[j0] >= 0 and blocks[j1] >= 0 and table.cache_id in ours:
                    missing.append(())
                    continue
                entries = self._missing(table, first_pos, last_pos)
                if entries or table.cache_id not in ours:  # a table's full checks where a block is mapped into
                    self._check_table(table)  # it; another cache's table: always
                missing.append(entries)
                needed += len(entries)
            if not needed:  # the usual call (a verify's rows inside blocks held): nothing changes hands
                return [[] for _ in missing]
            if needed > self.free_top[0]:
                raise CacheError(describe(f"MTP cache blocks for {what or f'{len(tables)} sequences'}",
                                          f"{needed} free block(s)", f"{self.free_top[0]} free of {self.num_blocks}",
                                          "free finished sequences, call trim_window, or size the pool larger"))
            return [self._allocate(table, m) for table, m in zip(tables, missing)]

    def table_rows(self, tables: Sequence[BlockTable]) -> np.ndarray:
        """The rows of tables an ensure of this cache fitted, as one int32 [S, max_blocks_per_seq] array.

        One concatenate: ``np.stack``'s per-array work costs 12 us at S = 16, in every verify.
        """
        return np.concatenate([table.blocks for table in tables]).reshape(len(tables), self.max_blocks_per_seq)

    def unmap(self, table: BlockTable, block_ids: Sequence[int]) -> None:
        """Give back blocks an ensure just mapped into ``table`` (the undo of that ensure)."""
        with self._lock:
            self._check_table(table)
            at = np.flatnonzero(np.isin(table.blocks, np.asarray(block_ids, dtype=np.int32)))
            if len(at) != len(block_ids):
                raise CacheError(describe("unmapped blocks", f"{list(block_ids)} mapped by the table",
                                          f"{table.blocks[at].tolist()} mapped"))
            for j in at.tolist():
                self._release(table, range(j, j + 1))

    def trim_window(self, table: BlockTable, next_pos: int) -> list[int]:
        """Return blocks wholly before the window of a write at ``next_pos`` to the pool.

        A block goes when all its positions are < next_pos - window + 1, so a sequence holds at
        most ceil(window / block_size) + 1 blocks at rest however long it runs.
        """
        if next_pos < 0:
            raise InputError(describe("trim_window next_pos", ">= 0", next_pos))
        stop = (next_pos - self.window + 1) // self.block_size  # blocks wholly before the window
        if stop <= table.num_trimmed:  # design note "trimmed front": nothing new behind the window
            return []
        with self._lock:
            self._check_table(table)
            freed = self._release(table, range(table.num_trimmed, min(stop, len(table.blocks))))
            table.num_trimmed = stop
            return freed

    # Design note "trimmed front": a long sequence's table is thousands of given-back -1 and then
    # the window's handful of blocks. Each table keeps how many of its entries are known -1
    # (``num_trimmed``), so a trim whose window starts at or before that costs one compare; only
    # an ensure and an install map entries, and both lower it.
    def trim_windows(self, tables: Sequence[BlockTable], next_positions: Sequence[int]) -> list[list[int]]:
        """``trim_window`` of several tables; the ids each gave back."""
        return [self.trim_window(table, p) for table, p in zip(tables, next_positions)]

    def truncate(self, table: BlockTable, length: int) -> list[int]:
        """Roll back to ``length`` positions: blocks wholly at positions >= length go back.

        A roll-back that gives nothing back (the usual one: the rejected drafts lay in the last
        block) changes nothing and returns at once; the table's checks run when a block goes.
        """
        if length < 0:
            raise InputError(describe("truncate length", ">= 0", length))
        first = -(-length // self.block_size)
        if _none_mapped(table.blocks[first:]):  # the usual roll-back: within the last block, nothing to give
            return []
        with self._lock:
            self._check_table(table)
            return self._release(table, range(first, len(table.blocks)))

    def free(self, table: BlockTable) -> list[int]:
        """Return every block of ``table``; the table is left empty and reusable."""
        with self._lock:
            self._check_table(table)
            freed = self._release(table, range(len(table.blocks)))
            table.num_trimmed = 0
            return freed

    def take(self, table: BlockTable) -> TakenBlocks:
        """Carry the table's blocks out (to install into a later state); the table is left empty."""
        with self._lock:
            ids = tuple(self._check_table(table))
            taken = TakenBlocks(tuple(table.entries()), ids, self.cache_id, next(self._serials))
            for block in ids:
                self._state[block] = LOOSE
                self._taken_by[block] = taken.serial
            table.blocks[:] = -1
            table.cache_id = table.num_trimmed = 0
            return taken

    def install(self, table: BlockTable, taken: TakenBlocks) -> None:
        """Map carried blocks into an empty ``table`` at their original logical positions."""
        with self._lock:
            if table.held():
                raise CacheError(describe("install target table", "an empty table", f"one holding {table.held()}",
                                          "free() or take() it first"))
            if taken.cache_id != self.cache_id:
                raise CacheError(describe("installed blocks", f"blocks of cache {self.cache_id}",
                                          f"blocks of cache {taken.cache_id}"))
            if len(taken.blocks) > self.max_blocks_per_seq:
                raise CacheError(describe("installed block map", f"<= {self.max_blocks_per_seq} entries",
                                          len(taken.blocks)))
            self._check_states(taken.block_ids, LOOSE, "install", taken.serial)
            for block in taken.block_ids:
                self._state[block] = OWNED
                del self._taken_by[block]
            self._fit(table)
            table.blocks[:] = -1
            table.blocks[: len(taken.blocks)] = taken.blocks
            table.num_trimmed = 0
            table.cache_id, table.block_size = self.cache_id, self.block_size

    def free_blocks(self, block_ids: TakenBlocks | Sequence[int]) -> None:
        """Return blocks no table owns (taken ones) to the pool; a double free raises."""
        serial = block_ids.serial if isinstance(block_ids, TakenBlocks) else None
        ids = block_ids.block_ids if isinstance(block_ids, TakenBlocks) else tuple(block_ids)
        with self._lock:
            if len(set(ids)) != len(ids):
                raise CacheError(describe("free_blocks ids", "distinct ids", list(ids), "a double free"))
            self._check_states(ids, LOOSE, "free_blocks", serial)
            for block in ids:
                self._state[block] = FREE
                del self._taken_by[block]
                self._push(block)

    # ---- helpers (under the lock) -------------------------------------------------------------
    def _fit(self, table: BlockTable) -> None:
        """Give an empty table (``BlockTable()``) its row of this cache's width."""
        if len(table.blocks) == 0:
            table.blocks = np.full(self.max_blocks_per_seq, -1, dtype=np.int32)

    def _allocate(self, table: BlockTable, missing: list[int]) -> list[int]:
        """Map a block from the top of the free stack at each of the (ascending) ``missing`` entries."""
        if not missing:
            return []
        self._fit(table)
        top = int(self.free_top[0])
        new = self.free_stack[top - len(missing) : top][::-1].tolist()  # popped one by one: the top first
        self.free_top[0] = top - len(missing)
        table.blocks[missing] = new
        self._state[new] = OWNED
        if missing[0] < table.trimmed[0]:  # design note "trimmed front"
            table.trimmed[0] = missing[0]
        table.cache_id, table.block_size = self.cache_id, self.block_size
        return new

    def _push(self, block: int) -> None:
        self.free_stack[self.free_top[0]] = block
        self.free_top[0] += 1

    def _release(self, table: BlockTable, logical: range) -> list[int]:
        """Free the blocks at the ``logical`` entries of a checked table."""
        row = table.blocks[logical.start : logical.stop]
        at = row >= 0
        released = row[at]
        if len(released):
            self._owned_by(table, released)  # entries before the checked part too (free's whole row)
            row[at] = -1
            self._state[released] = FREE
            top = int(self.free_top[0])  # pushed one by one in table order: the last on top
            self.free_stack[top : top + len(released)] = released
            self.free_top[0] = top + len(released)
        if table.cache_id and table.is_empty:
            table.cache_id = 0
        return released.tolist()

    def _missing(self, table: BlockTable, first_pos: int, last_pos: int) -> list[int]:
        bs, blocks = self.block_size, table.blocks
        return [j for j in range(first_pos // bs, last_pos // bs + 1) if j >= len(blocks) or blocks[j] < 0]

    def _check_range(self, first_pos: int, last_pos: int) -> None:
        if not (0 <= first_pos <= last_pos < self.max_seq_len):
            raise InputError(describe("cache positions first..last", f"0 <= first <= last < {self.max_seq_len}",
                                      f"{first_pos}..{last_pos}"))

    def _check_table(self, table: BlockTable) -> list[int]:
        """The table's held blocks, after checking it maps only blocks of this cache that it owns."""
        if len(table.blocks) not in (0, self._width):
            raise CacheError(describe("block table width", f"{self._width} entries",
                                      len(table.blocks), "make tables with cache.new_table()"))
        held = table.held_ids()
        if not len(held):
            return []
        if table.cache_id != self.cache_id:
            raise CacheError(describe("block table", f"a table of cache {self.cache_id}",
                                      f"one mapping blocks of cache {table.cache_id}"))
        return self._owned_by(table, held)

    def _owned_by(self, table: BlockTable, blocks: np.ndarray) -> list[int]:
        """``blocks`` (ids >= 0 that ``table`` maps) as a list, after checking that each is a block of
        this pool in the OWNED state, mapped once: else the CacheError of a table edited by hand or
        a block freed behind its back (nothing changed)."""
        try:  # the states as bytes against a run of OWNED: one compare
            states = self._state[blocks]
            owned = states.tobytes() == _OWNED_RUN[: len(blocks)] if len(blocks) <= len(_OWNED_RUN) \
                else bool((states == OWNED).all())
        except IndexError:  # an id past the pool
            owned = False
        ids = blocks.tolist()
        if owned and (len(ids) < 2 or len(set(ids)) == len(ids)):
            return ids
        bad = [b for b in ids if b >= len(self._state) or self._state[b] != OWNED]
        bad = bad or sorted({b for b in ids if ids.count(b) > 1})
        raise CacheError(describe("block table entries", "blocks this table owns, each mapped once",
                                  f"{bad} in {table.entries()}"))

    def _check_states(self, ids: Sequence[int], want: int, what: str, serial: int | None = None) -> None:
        wrong = []
        for block in ids:
            if not (isinstance(block, int) and 0 <= block < self.num_blocks):
                wrong.append(f"{block} (no such block)")
            elif self._state[block] != want:
                wrong.append(f"{block} ({_STATE_NAMES[int(self._state[block])]})")
            elif serial is not None and self._taken_by[block] != serial:
                wrong.append(f"{block} (freed since, and taken again by another take)")
        if wrong:
            stale = any("(free)" in w or "again" in w for w in wrong)
            hint = "a double free, or a stale TakenBlocks" if stale else "blocks must come from take()"
            raise CacheError(describe(f"{what} blocks", f"blocks {_STATE_NAMES[want]}", ", ".join(wrong), hint))

    def __repr__(self) -> str:
        return (f"PagedLatentCache({self.num_free_blocks}/{self.num_blocks} blocks free, block {self.block_size}, "
                f"head_dim {self.head_dim}, window {self.window}, {self.kv.dtype})")
