"""PagedLatentCache: the MTP attention's own paged latent cache (never the target's).

MLA-shaped, as in the seed: one KV head, rows of ``cache_head_dim`` (kv_lora_rank +
qk_rope_head_dim = 512 for V4-Flash) in bf16, blocks of 16 positions. Storage is one tensor
``kv`` [num_blocks * block_size, head_dim]; the slot of position p of a sequence is
``table[p // 16] * 16 + p % 16``.

Block ownership (design note "block states"): every physical block is in exactly one state,

    FREE  --ensure-->  OWNED (by one BlockTable)  --take-->  LOOSE (carried by the caller)
      ^                    |  trim / truncate / free            |  install --> OWNED
      +--------------------+------------------------------------+  free_blocks --> FREE

and every transition is checked, so a double free, freeing a block a table still maps, or
installing a block twice raises :class:`CacheError`. Every operation validates first and
mutates after, under one lock: on any error nothing changes, neither a table nor the pool.

Metadata packing (the seed's row layout, one uint8 row per sequence, so one host-to-device
copy stages a whole batch) lives in :mod:`draftgraph.runtime.cache.metadata`.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field
from operator import le
from typing import NamedTuple

import torch
from draftgraph.runtime.cache.metadata import MetadataView, max_blocks_for, pack_metadata
from draftgraph.runtime.errors import CacheError, InputError, describe
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.native import build as native_build

__all__ = ["BlockTable", "MetadataView", "PagedLatentCache", "TakenBlocks", "pack_metadata"]

FREE, OWNED, LOOSE = 0, 1, 2
_STATE_NAMES = {FREE: "free", OWNED: "owned by a table", LOOSE: "taken (owned by no table)"}
_cache_ids = itertools.count(1)


@dataclass(slots=True)  # read by slot offset in the compiled loops (runtime/decode_pass.c, cache_rows.c)
class BlockTable:
    """One sequence's map from logical block ``p // block_size`` to a physical block id.

    ``blocks[j]`` is -1 for a block never allocated or already given back (window, rollback).
    The proposer state holds one; only :class:`PagedLatentCache` mutates it.
    """

    blocks: list[int] = field(default_factory=list)
    block_size: int = 16
    cache_id: int = 0  # the cache whose blocks it maps; 0 while it maps none
    # Entries below it are -1 (design note "trimmed front"): kept by the cache, never too high.
    num_trimmed: int = 0
    # The serial of the last propose pass that read it (draftgraph.runtime.proposer.front): not the table's state.
    pass_mark: int = field(default=0, init=False, compare=False, repr=False)

    def block_of(self, pos: int) -> int:
        """Physical block id of position ``pos``, or -1."""
        j = pos // self.block_size
        return self.blocks[j] if 0 <= j < len(self.blocks) else -1

    def slot(self, pos: int) -> int:
        """Row of ``kv`` that holds position ``pos``; CacheError when no block covers it."""
        block = self.block_of(pos) if pos >= 0 else -1
        if block < 0:
            raise CacheError(
                describe(
                    f"slot of position {pos}",
                    "a position with an allocated block",
                    f"no block (table {self.blocks})",
                    "call cache.ensure() first",
                )
            )
        return block * self.block_size + pos % self.block_size

    def held(self) -> list[int]:
        """Physical ids this table maps, in logical order.

        A long sequence's table is thousands of -1 (blocks behind the window, given back) then
        a few held ones. Entries below ``num_trimmed`` are -1 (design note "trimmed front" in
        :class:`PagedLatentCache`), so only the rest is read: the window's handful, however long
        the sequence (at position 100k, 6,250 entries, a count over the whole table cost 3.3 us
        on the CI machine, at every block a propose ensured or trimmed, and twice per trim).
        When every -1 left is in front, the held ones are the tail.
        """
        blocks = self.blocks[self.num_trimmed :] if self.num_trimmed > 0 else self.blocks
        tail = blocks[blocks.count(-1) :]
        if not tail or min(tail) >= 0:
            return tail
        return [b for b in blocks if b >= 0]

    @property
    def is_empty(self) -> bool:
        return not self.held()


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
        block_size: int = 16,
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
                raise InputError(
                    describe(
                        "PagedLatentCache(head_dim, ...)",
                        "window= and max_seq_len=",
                        f"window={window}, max_seq_len={max_seq_len}",
                        "or pass a V4Config, which has both",
                    )
                )
        for what, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("window", window),
            ("max_seq_len", max_seq_len),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise InputError(describe(what, "an int >= 1", value))
        self.head_dim, self.block_size, self.window, self.max_seq_len = (
            head_dim,
            block_size,
            window,
            max_seq_len,
        )
        self.cache_id = next(_cache_ids)
        self.kv = torch.zeros(num_blocks * block_size, head_dim, dtype=dtype, device=device)  # [P*16, d]
        self._lock = threading.Lock()
        self._state = [FREE] * num_blocks
        self._taken_by: dict[int, int] = {}  # LOOSE block -> serial of the take() that loosed it
        self._serials = itertools.count(1)
        # A stack: the most recently freed block is reused first (its rows are likely cached).
        self._free = list(range(num_blocks))

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._state)

    @property
    def block_states(self) -> list[int]:
        """FREE / OWNED / LOOSE per physical block: the pool's own list, to read, never to write.

        Read as it is by the one-pass held test of a propose (:mod:`draftgraph.runtime.proposer.front`), where a
        copy or a call per row would cost what the pass saves.
        """
        return self._state

    def ensure_sink(self) -> tuple[threading.Lock, object, list[int]]:
        """(the lock, the compiled ensure of rows or None, the free list) for a propose's compiled front.

        :mod:`draftgraph.runtime.proposer.front` ensures the rows its pass found unheld inside the same C call
        (design note "compiled front" there), under this lock, with the function
        :meth:`ensure_unheld` calls (``cache_rows.c``'s ``ensure_tables``): the one other caller
        that maps blocks. None where that cannot be built: the front leaves the ensure to the proposer.
        """
        native = native_build.load("cache_rows")
        return self._lock, (native.ensure_tables if native is not None else None), self._free

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def max_blocks_per_seq(self) -> int:
        """Entries of a metadata block table: ceil(max_seq_len / block_size) + 1."""
        return max_blocks_for(self.max_seq_len, self.block_size)

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
            return self.blocks_needed(table, first_pos, last_pos) <= len(self._free)

    # ---- mutations (validate, then mutate, under the lock) -----------------------------------
    def ensure(self, table: BlockTable, first_pos: int, last_pos: int) -> list[int]:
        """Give positions ``first_pos..last_pos`` (inclusive) slots; returns the new block ids.

        Raises CacheError (pool exhausted, with needed / free counts) and changes nothing when
        the pool cannot supply every block the range needs.
        """
        self._check_range(first_pos, last_pos)
        with self._lock:
            if not self._unheld_rows([table], [first_pos], [last_pos]):
                return []  # design note "held rows"
            self._check_table(table)
            missing = self._missing(table, first_pos, last_pos)
            self._check_free(len(missing), f"positions {first_pos}..{last_pos}")
            return self._allocate(table, missing)

    def ensure_batch(self, tables: list[BlockTable], first_positions: list[int], last_positions: list[int]) -> list:
        """``ensure`` for several distinct tables under one lock, all or nothing; the new ids per table.

        Raises CacheError (pool exhausted, with needed / free counts) and changes nothing when
        the pool cannot supply every block of every range (a batched propose's host path).
        A row whose range is held already (design note "held rows") is left as it is.
        """
        if len(set(map(id, tables))) != len(tables):
            raise InputError(describe("ensure_batch tables", "distinct tables", "the same table twice"))
        self._check_ranges(first_positions, last_positions)
        with self._lock:
            todo = self._unheld_rows(tables, first_positions, last_positions)
            added = [[] for _ in tables]
            for i, new in self._ensure_rows(tables, first_positions, last_positions, todo).items():
                added[i] = new
            return added

    def ensure_unheld(self, tables: list[BlockTable], first_positions: list[int], num_positions: int,
                      rows: list[int] | None = None) -> list[tuple[int, int, list[int]]]:
        """``ensure_batch`` of the ranges ``p .. p + num_positions - 1`` of tables the caller proved distinct.

        A propose's host path: what it needs back is an undo record for each row that got blocks,
        (row, the table's length before, the new ids), and [] when every row is held (design note
        "held rows"), the usual step. ``rows``: the only rows that may be unheld, when the caller
        found the others held in its own pass (:mod:`draftgraph.runtime.proposer.front`). Raises as
        ``ensure_batch`` does, and then changes nothing.
        """
        span = num_positions - 1
        native = native_build.load("cache_rows") if rows is not None else None
        if native is not None:  # the rows the pass found unheld, ensured in C (design note "compiled pass")
            with self._lock:
                records = native.ensure_tables(tables, first_positions, span, rows, BlockTable, self._free,
                                               self._state, self.cache_id, self.block_size, OWNED, self.max_seq_len)
            if records is not NotImplemented:
                return records
        firsts = first_positions if rows is None else [first_positions[i] for i in rows]
        lasts = [p + span for p in firsts] if span else firsts
        if firsts and (span < 0 or min(firsts) < 0 or max(lasts) >= self.max_seq_len):
            self._check_ranges(firsts, lasts)  # raises for the first bad range
        with self._lock:
            found = self._unheld_rows(tables if rows is None else [tables[i] for i in rows], firsts, lasts)
            todo = found if rows is None else [rows[i] for i in found]
            if not todo:
                return []
            lengths = [len(tables[i].blocks) for i in todo]
            last_positions = [p + span for p in first_positions] if span else first_positions
            added = self._ensure_rows(tables, first_positions, last_positions, todo)
            return [(i, length, added[i]) for i, length in zip(todo, lengths) if added[i]]

    def _ensure_rows(self, tables: list[BlockTable], first_positions: list[int], last_positions: list[int],
                     todo: list[int]) -> dict[int, list[int]]:
        """The new ids of each row in ``todo``, all or nothing (under the lock; what=the batch's size)."""
        missing = {}
        for i in todo:
            self._check_table(tables[i])
            missing[i] = self._missing(tables[i], first_positions[i], last_positions[i])
        if missing:
            self._check_free(sum(map(len, missing.values())), f"{len(tables)} sequences")
        return {i: self._allocate(tables[i], m) for i, m in missing.items()}

    def _check_ranges(self, first_positions: list[int], last_positions: list[int]) -> None:
        """``_check_range`` of every row: three passes of builtins prove the usual batch good."""
        if not first_positions or (min(first_positions) >= 0 and max(last_positions) < self.max_seq_len
                                   and all(map(le, first_positions, last_positions))):
            return
        for first_pos, last_pos in zip(first_positions, last_positions):
            self._check_range(first_pos, last_pos)

    # Design note "held rows": in a decode step most rows write inside blocks they hold already,
    # and for such a row ensure allocates nothing: checking its whole table (held(), a pass over
    # thousands of entries for a long sequence, ~1 us) is all ensure would do. A row counts as
    # held when its range spans at most two entries, both mapping blocks of this cache in state
    # OWNED; one inline loop over the batch finds the rows that are not. Only those go through
    # the full ensure, which checks the whole table; the rest of a held row's table is checked
    # when a trim gives its blocks back (design note "trimmed front"). Nothing a propose writes
    # goes outside the held entries: its other entries are only read (the window's keys). A
    # propose's own pass (draftgraph.runtime.proposer.front) tests its rows this way inline and calls
    # ``ensure_unheld`` for the rest only; the proposer has proved its tables distinct.
    def _unheld_rows(self, tables: list[BlockTable], first_positions: list[int],
                     last_positions: list[int]) -> list[int]:
        """Indices of the rows not held (design note "held rows"): the rows ensure may change or refuse."""
        bs, states, cache_id, unheld = self.block_size, self._state, self.cache_id, []
        for i, table in enumerate(tables):
            blocks, first = table.blocks, first_positions[i] // bs
            try:  # one entry (the usual range) is one lookup; the second only when the range crosses
                block = blocks[first]
                if block < 0 or states[block] != OWNED or table.cache_id != cache_id:
                    unheld.append(i)
                elif (last := last_positions[i] // bs) != first and (
                        last - first > 1 or (block := blocks[last]) < 0 or states[block] != OWNED):
                    unheld.append(i)
            except IndexError:  # past the table, or an entry past the pool (a table edited by hand)
                unheld.append(i)
        return unheld

    def _check_free(self, needed: int, what: str) -> None:
        if needed > len(self._free):
            raise CacheError(
                describe(
                    f"MTP cache blocks for {what}",
                    f"{needed} free block(s)",
                    f"{len(self._free)} free of {self.num_blocks}",
                    "free finished sequences, call trim_window, or size the pool larger",
                )
            )

    def _allocate(self, table: BlockTable, missing: list[int]) -> list[int]:
        if not missing:
            return []
        new = [self._free.pop() for _ in missing]
        last = max(missing)
        table.num_trimmed = min(table.num_trimmed, min(missing))  # design note "trimmed front"
        table.blocks.extend([-1] * (last + 1 - len(table.blocks)))
        for j, block in zip(missing, new):
            table.blocks[j] = block
            self._state[block] = OWNED
        table.cache_id, table.block_size = self.cache_id, self.block_size
        return new

    def trim_window(self, table: BlockTable, next_pos: int) -> list[int]:
        """Return blocks wholly before the window of a write at ``next_pos`` to the pool.

        A block goes when all its positions are < next_pos - window + 1, so a sequence holds at
        most ceil(window / block_size) + 1 blocks at rest however long it runs.
        """
        return self.trim_windows([table], [next_pos])[0]

    def trim_windows(self, tables: list[BlockTable], next_positions: list[int]) -> list[list[int]]:
        """``trim_window`` for several tables under one lock; every table that gives blocks back is checked first."""
        released = [[] for _ in tables]
        for i, blocks in self.trim_batch(tables, next_positions).items():
            released[i] = blocks
        return released

    # Design note "trimmed front": a long sequence's table is thousands of given-back -1 and then
    # the window's handful of blocks, and every propose trims every row. Each table keeps how many
    # of its entries are known -1 (``num_trimmed``): a trim whose window starts at or before that
    # has nothing to give back and costs two compares, whatever the table's length (a scan of
    # it, and the check of every held block, cost ~1 us a row at B = 32). The cache keeps the
    # count at or below the truth: only an ensure and an install map entries, and both lower it
    # (an ensure to the lowest entry it fills, an install to 0). A table edited by hand below its
    # count is not trimmed there (``free`` and ``truncate`` still give its blocks back).
    def trim_batch(self, tables: list[BlockTable], next_positions: list[int]) -> dict[int, list[int]]:
        """``trim_windows``' work: the rows that gave blocks back, and their ids (none, the usual propose)."""
        if next_positions and min(next_positions) < 0:
            raise InputError(describe("trim_window next_pos", ">= 0", min(next_positions)))
        shift, bs = self.window - 1, self.block_size
        with self._lock:
            native = native_build.load("cache_rows")
            if native is not None and type(tables) is list and type(next_positions) is list:
                released = native.trim_tables(tables, next_positions, BlockTable, self._free, self._state,
                                              self.cache_id, self.window, bs, FREE, OWNED)
                if released is not NotImplemented:  # design note "compiled pass" (runtime/proposer/front.py)
                    return released
            todo = []
            for i, (table, next_pos) in enumerate(zip(tables, next_positions)):
                stop = (next_pos - shift) // bs  # blocks wholly before the window (<= 0: none)
                if stop > table.num_trimmed:
                    todo.append((i, stop))
            for i, _ in todo:  # every table checked before any change
                self._check_table(tables[i])
            released = {}
            for i, stop in todo:
                table = tables[i]
                freed = self._release_checked(table, range(table.num_trimmed, min(stop, len(table.blocks))))
                table.num_trimmed = stop
                if freed:
                    released[i] = freed
            return released

    def truncate(self, table: BlockTable, length: int) -> list[int]:
        """Roll back to ``length`` positions: blocks wholly at positions >= length go back."""
        if length < 0:
            raise InputError(describe("truncate length", ">= 0", length))
        first_dropped = -(-length // self.block_size)
        return self._release(table, range(first_dropped, len(table.blocks)), keep=first_dropped)

    def free(self, table: BlockTable) -> list[int]:
        """Return every block of ``table``; the table is left empty and reusable."""
        return self._release(table, range(len(table.blocks)), keep=0)

    def take(self, table: BlockTable) -> TakenBlocks:
        """Carry the table's blocks out (to install into a later state); the table is left empty."""
        with self._lock:
            self._check_table(table)
            ids = tuple(table.held())
            taken = TakenBlocks(tuple(table.blocks), ids, self.cache_id, next(self._serials))
            for block in ids:
                self._state[block] = LOOSE
                self._taken_by[block] = taken.serial
            table.blocks.clear()
            table.cache_id = 0
            return taken

    def install(self, table: BlockTable, taken: TakenBlocks) -> None:
        """Map carried blocks into an empty ``table`` at their original logical positions."""
        with self._lock:
            if table.held():
                raise CacheError(
                    describe(
                        "install target table",
                        "an empty table",
                        f"one holding {table.held()}",
                        "free() or take() it first",
                    )
                )
            if taken.cache_id != self.cache_id:
                raise CacheError(
                    describe(
                        "installed blocks",
                        f"blocks of cache {self.cache_id}",
                        f"blocks of cache {taken.cache_id}",
                    )
                )
            self._check_states(taken.block_ids, LOOSE, "install", taken.serial)
            for block in taken.block_ids:
                self._state[block] = OWNED
                del self._taken_by[block]
            table.blocks[:] = list(taken.blocks)
            table.num_trimmed = 0  # the first trim finds its front again (design note "trimmed front")
            table.cache_id, table.block_size = self.cache_id, self.block_size

    def free_blocks(self, block_ids: TakenBlocks | list[int] | tuple[int, ...]) -> None:
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
                self._free.append(block)

    # ---- helpers ------------------------------------------------------------------------------
    def _release(self, table: BlockTable, logical, keep: int | None = None) -> list[int]:
        """Free the blocks at ``logical`` indices; ``keep`` also shortens the table to that length."""
        with self._lock:
            self._check_table(table)
            return self._release_checked(table, logical, keep)

    def _release_checked(self, table: BlockTable, logical, keep: int | None = None) -> list[int]:
        """``_release`` under the lock, of a table already checked."""
        released = []
        for j in logical:
            block = table.blocks[j] if j < len(table.blocks) else -1
            if block >= 0:
                released.append(block)
                table.blocks[j] = -1
                self._state[block] = FREE
                self._free.append(block)
        if keep is not None:
            del table.blocks[keep:]
        if table.cache_id and not table.held():
            table.cache_id = 0
        return released

    def _missing(self, table: BlockTable, first_pos: int, last_pos: int) -> list[int]:
        bs, blocks = self.block_size, table.blocks
        if first_pos // bs == last_pos // bs:  # the usual propose: one block, most often held already
            j = first_pos // bs
            return [] if j < len(blocks) and blocks[j] >= 0 else [j]
        return [
            j
            for j in range(first_pos // bs, last_pos // bs + 1)
            if j >= len(table.blocks) or table.blocks[j] < 0
        ]

    def _check_range(self, first_pos: int, last_pos: int) -> None:
        if not (0 <= first_pos <= last_pos < self.max_seq_len):
            raise InputError(
                describe(
                    "cache positions first..last",
                    f"0 <= first <= last < {self.max_seq_len}",
                    f"{first_pos}..{last_pos}",
                )
            )

    def _check_table(self, table: BlockTable) -> list[int]:
        """The table's held blocks, after checking it maps only blocks of this cache that it owns."""
        held = table.held()
        if not held:
            return held
        if table.cache_id != self.cache_id:
            raise CacheError(
                describe(
                    "block table",
                    f"a table of cache {self.cache_id}",
                    f"one mapping blocks of cache {table.cache_id}",
                )
            )
        num_blocks, states = len(self._state), self._state
        for b in held:  # a plain loop: all() over a generator costs more for the usual handful
            if b >= num_blocks or states[b] != OWNED:
                break
        else:
            return held
        bad = [b for b in held if b >= num_blocks or states[b] != OWNED]
        # a table edited by hand, or a block freed behind its back
        raise CacheError(describe("block table entries", "blocks this table owns", f"{bad} in {table.blocks}"))

    def _check_states(self, ids: tuple[int, ...], want: int, what: str, serial: int | None = None) -> None:
        wrong = []
        for block in ids:
            if not (isinstance(block, int) and 0 <= block < self.num_blocks):
                wrong.append(f"{block} (no such block)")
            elif self._state[block] != want:
                wrong.append(f"{block} ({_STATE_NAMES[self._state[block]]})")
            elif serial is not None and self._taken_by[block] != serial:
                wrong.append(f"{block} (freed since, and taken again by another take)")
        if wrong:
            stale = any("(free)" in w or "again" in w for w in wrong)
            hint = "a double free, or a stale TakenBlocks" if stale else "blocks must come from take()"
            raise CacheError(
                describe(f"{what} blocks", f"blocks {_STATE_NAMES[want]}", ", ".join(wrong), hint)
            )

    def pack_metadata(self, rows) -> torch.Tensor:
        """:func:`pack_metadata` with this cache's ``max_blocks_per_seq``."""
        return pack_metadata(rows, self.max_blocks_per_seq)

    def __repr__(self) -> str:
        return (
            f"PagedLatentCache({self.num_free_blocks}/{self.num_blocks} blocks free, "
            f"block {self.block_size}, head_dim {self.head_dim}, window {self.window}, {self.kv.dtype})"
        )
