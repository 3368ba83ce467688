"""The usual decode batch in one pass: its checks, its held blocks and its metadata rows.

Design note "one pass": a propose of B sequences went over its batch once per kind of work:
the states, the tables' distinctness, the tokens and the positions (design note "bulk checks"
in :mod:`draftgraph.runtime.proposer.checks`), the held-block scan (design note "held rows" in
:mod:`draftgraph.runtime.cache.paged_cache`), the metadata rows, and the staging writes (design note "incremental
staging" in :mod:`draftgraph.runtime.cache.metadata`): seven loops, ~0.9 us a row on the 2-core CI machine
and ~2.3 on the H200 hosts, most of a propose's host time at B = 32. The usual batch (every
item well formed, every table distinct, most rows writing inside blocks they hold) needs one
loop: each row is checked and, when it is held, staged as it is read.

The pass gives up (returns None) at the first thing it does not expect, and puts back the rows
it wrote (``MetadataWriter.save`` / ``restore``): the general path then checks item by item
and raises the error of the first bad item, as it always did, with the staging buffer as it
was. Rows that need blocks are only listed: the proposer ensures them (all or nothing) and
stages them after, checked as its general path checks rows. A propose refused after the pass
restores the rows too.

Design note "compiled pass": on the lent H200 hosts this loop still cost 33-63 us at B = 32
(their Python runs it 2-2.6x slower than the CI machine's), and each row that needs a block
(about six a step at B = 32, K = 3 in serving, where rows cross blocks on different steps) cost
~10 us more in the ensure, its staging and the trim. The per-row loops are C, built on first use
by :mod:`draftgraph.runtime.native.build`: ``decode_pass.c`` (this loop, and the restage of the ensured
rows, writing moved block tables itself) and ``cache_rows.c`` (``PagedLatentCache``'s ensure of
those rows and its trim), sharing ``native_attrs.h``. States and tables are slotted
dataclasses, so the C code reads their fields at their slot offsets (a load each, where a lookup
by name costs ~25 ns; a table of another type is read by name). It reads only exact ints,
lists, tuples and bools, as the Python loops read them, and leaves anything else to them (it
answers NotImplemented; nothing is changed, or the rows it wrote are restored first), so the two
never decide differently: ``tests/test_decode_pass_compiled.py`` spoils batches and tables at
random and compares both, and every decode-pass and cache test runs on both. Without a C
compiler, or with ``DRAFTGRAPH_NATIVE=0``, the Python loops run.

Design note "compiled front": with the loops compiled, what was left of a propose's host time
at B = 32 was the Python between them: the save of the rows, the pass, the table list and the
ensure of the rows that need blocks with its undo records, their restage, the padding and
the tokens, each a call with its own arguments (~3.5 of ~13 us on the CI machine, where a
replay's host time is ~2-4x that on the H200 hosts). ``decode_pass.c``'s ``stage_batch`` does
them in one call, under the cache's lock: it saves every row's scalars and record first (so
``MetadataWriter.restore`` puts the rows back whatever comes after), runs the pass, calls the
compiled ensure on the rows that need blocks (``cache.ensure_sink``), stages those rows again,
writes the padding and the tokens. It answers as the pass does (None, NotImplemented) or
(unheld, records, done); anything it does not do (no compiled ensure, a row the restage leaves
to Python) it says with ``done`` False, and the proposer does that part as it did after the
pass. The proposer checks the hiddens and the mask before the front, so that a batch refused
for them has mapped no block; its error is still the first kind's (states, tokens, positions,
then hiddens). The stage_batch context (the writer's, staging's and cache's buffers and
constants) is made once per staging buffer (``_front_context``). After the read-back, the
drafts go back into the states in one call too (``commit_rows``), and the launch between is
one C call (design note "compiled launch" in :mod:`draftgraph.runtime.execution.launch`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from draftgraph.runtime.cache.metadata import BLOCK_TABLE_OFFSET, SCALARS, MetadataWriter
from draftgraph.runtime.cache.paged_cache import OWNED, BlockTable, PagedLatentCache
from draftgraph.runtime.native import build as native_build
from draftgraph.runtime.proposer.state import MtpProposerState


class UsualBatch(NamedTuple):
    """What one pass found: the rows still to stage."""

    unheld: list[int]  # rows whose range needs blocks: ensure them, then stage them


class StagedFront(NamedTuple):
    """What :func:`stage_front` did with a usual batch."""

    unheld: list[int]  # rows whose range needed blocks
    records: list[tuple[int, int, list[int]]] | None  # (row, length before, new ids); None: not ensured here
    done: bool  # every row staged, the rows past the batch padding, the tokens written


# Each pass marks the tables it reads with a serial of its own: a table marked already is one
# two rows share (the same state twice, or two states given one table), found with one compare a
# row instead of a set of the batch's tables after the loop (~2.7 us at B = 32 on the CI machine).
_passes = itertools.count(1)


def kv_start_after(state: MtpProposerState, position: int) -> int:
    """The state's kv_start once a propose at ``position`` staged its rows.

    A propose continuing the state's rows (kv_start <= p <= seq_len) keeps its kv_start; one
    that jumps ahead, or back before them, starts the rows afresh at p.
    """
    kv_start = state.kv_start
    return kv_start if kv_start <= position <= state.seq_len else position


def stage_usual_batch(writer: MetadataWriter, cache: PagedLatentCache, states: Sequence, tokens: Sequence,
                      positions: Sequence, num_drafts: int, owner: int, vocab: int) -> UsualBatch | None:
    """Check the batch and stage the metadata rows of its held rows, in one loop; None when it is unusual.

    Passes exactly the batches the general path passes without raising, except for those it
    leaves to that path (None): a state, token or position of another type, a table shared by
    two rows, a writer without a window. Rows past the batch are not touched (padding is the
    caller's, with ``writer.write_padding_from``). A caller that refuses the batch after the
    pass calls ``writer.restore()``.
    """
    window = writer.window
    if window is None:
        return None
    writer.save()
    try:
        native = native_loop()
        if native is not None:  # design note "compiled pass"
            unheld = _compiled_stage(native, writer, cache, states, tokens, positions, num_drafts, owner, vocab)
            if unheld is not NotImplemented:
                if unheld is not None:
                    return UsualBatch(unheld)
                writer.restore()
                return None
            writer.restore()  # it left the batch to the Python loop, which decides from the same rows
        unheld = _stage_rows_python(writer, cache, states, tokens, positions, num_drafts, owner, vocab)
    except BaseException:
        writer.reset()  # not expected; the records must stay true whatever happened
        raise
    if unheld is None:
        writer.restore()  # a row broke the loop: the staging buffer as it was
        return None
    return UsualBatch(unheld)


def stage_front(staging, cache: PagedLatentCache, states: Sequence, tokens: Sequence, positions: Sequence,
                num_drafts: int, owner: int, vocab: int) -> StagedFront | None:
    """A propose's front for the usual batch: the pass, the ensure of its unheld rows, their rows,
    the padding and the tokens, in one compiled call (design note "compiled front"); None when the
    batch is unusual (the general path decides, the staging buffer as it was).

    Where something is not done (no compiled loop: the pass alone, in Python; an ensure left to
    Python; a row the restage leaves to the general path), ``done`` is False and the caller does
    the rest as it does after :func:`stage_usual_batch`. Records not None: the blocks are mapped
    already, and a refusal after must undo them. A refusal after this restores the rows
    (``staging.writer.restore()``).
    """
    writer = staging.writer
    native = native_loop()
    if native is None or writer.window is None:
        usual = stage_usual_batch(writer, cache, states, tokens, positions, num_drafts, owner, vocab)
        return None if usual is None else StagedFront(usual.unheld, None, False)
    lock, context = _front_context(staging, cache, native)
    try:
        with lock:
            front = native.stage_batch(states, tokens, positions, num_drafts, owner, vocab, next(_passes),
                                       next(_passes), context)
    except BaseException:
        writer.reset()  # not expected (a MemoryError before any block was mapped): the records must stay true
        raise
    if front is None:  # a row broke the pass: the general path raises its error
        writer.restore()
        return None
    if front is NotImplemented:  # left to the Python loop, which decides from the same rows
        writer.restore()
        usual = stage_usual_batch(writer, cache, states, tokens, positions, num_drafts, owner, vocab)
        return None if usual is None else StagedFront(usual.unheld, None, False)
    return StagedFront(*front)


def commit_rows(states: Sequence, positions: Sequence, drafted: Sequence[list[int]],
                num_drafts: int) -> tuple[list[int], list[BlockTable]]:
    """Write a propose's drafts back into its states; (the rows that drafted fewer than
    ``num_drafts``, the states' tables).

    Per row: ``kv_start`` kept when ``p`` continues the rows, else ``p`` (:func:`kv_start_after`);
    ``seq_len = p + drafts``; ``last_num_drafted = drafts``. In C where it is built (after
    the read-back every microsecond is on the decode loop's critical path), else this loop.
    """
    native = native_loop()
    if native is not None:
        answer = native.commit_rows(states, positions, drafted, num_drafts, MtpProposerState)
        if answer is not NotImplemented:
            return answer
    short = []
    for i, (state, p, row) in enumerate(zip(states, positions, drafted)):  # kv_start_after, inline
        kv_start, num_drafted = state.kv_start, len(row)
        state.kv_start = kv_start if kv_start <= p <= state.seq_len else p
        state.seq_len, state.last_num_drafted = p + num_drafted, num_drafted
        if num_drafted < num_drafts:
            short.append(i)
    return short, [state.table for state in states]


def _front_context(staging, cache: PagedLatentCache, native) -> tuple:
    """(the cache's lock, stage_batch's context): made once per staging buffer, cache and built modules.

    Everything in it is the same object at every propose (the writer keeps its record list, the
    cache its free list and block states): ~20 attribute reads and calls a propose saves.
    """
    lock, ensure, free = cache.ensure_sink()
    kept = staging.__dict__.get("_front_context")
    if kept is not None and kept[0] is cache and kept[1] is native and kept[2] is ensure:
        return kept[3], kept[4]
    writer = staging.writer
    mem, row_bytes, written = writer.row_sink()
    saved, saved_written = writer.save_sink()
    token_mem, token_at = staging.token_sink()
    context = (MtpProposerState, mem, row_bytes, written, cache.block_states, cache.block_size, cache.cache_id,
               cache.max_seq_len, writer.window, writer.max_blocks, BLOCK_TABLE_OFFSET, OWNED, BlockTable, ensure,
               free, saved, saved_written, token_mem, token_at)
    staging.__dict__["_front_context"] = (cache, native, ensure, lock, context)
    return lock, context


def native_loop():
    """The compiled pass (``decode_pass.c``, runtime/native/build.py), or None where it cannot be built."""
    return native_build.load("decode_pass")


def _compiled_stage(native, writer: MetadataWriter, cache: PagedLatentCache, states: Sequence, tokens: Sequence,
                    positions: Sequence, num_drafts: int, owner: int, vocab: int, rows: list[int] | None = None):
    """The compiled ``stage_rows``: the unheld rows, None (a row broke it) or NotImplemented (left to Python)."""
    mem, row_bytes, written = writer.row_sink()
    return native.stage_rows(states, tokens, positions, num_drafts, owner, vocab, next(_passes), MtpProposerState,
                             mem, row_bytes, written, cache.block_states, cache.block_size, cache.cache_id,
                             cache.max_seq_len, writer.window, writer.max_blocks, BLOCK_TABLE_OFFSET, OWNED,
                             BlockTable, rows)


def stage_ensured_rows(writer: MetadataWriter, cache: PagedLatentCache, states: Sequence, tokens: Sequence,
                       positions: Sequence, num_drafts: int, owner: int, vocab: int, rows: list[int]) -> bool:
    """Stage ``rows`` (the pass's unheld rows, ensured since) with the compiled loop; False where it did not.

    True: every one of them is held now and staged. False (no compiled loop, or a row it leaves
    to Python): the caller stages them its general way, which rewrites any row written here
    with the same bytes, or raises. The pass's ``writer.save()`` stands: a refusal after this
    still restores the rows as they were before the propose.
    """
    native = native_loop()
    if native is None or writer.window is None:
        return False
    try:
        unheld = _compiled_stage(native, writer, cache, states, tokens, positions, num_drafts, owner, vocab, rows)
    except BaseException:
        writer.reset()  # the records must stay true whatever happened (as the pass)
        raise
    return unheld == []


def _stage_rows_python(writer: MetadataWriter, cache: PagedLatentCache, states: Sequence, tokens: Sequence,
                       positions: Sequence, num_drafts: int, owner: int, vocab: int) -> list[int] | None:
    """The pass's loop, in Python: the unheld rows, or None when a row breaks it (the caller restores)."""
    window, max_blocks = writer.window, writer.max_blocks
    mem, row_bytes, written = writer.row_sink()
    bs, block_states, cache_id = cache.block_size, cache.block_states, cache.cache_id
    span, pack = num_drafts - 1, SCALARS.pack_into
    first_too_far = cache.max_seq_len - span  # p + span < max_seq_len: the cache's range check
    unheld: list[int] = []
    serial = next(_passes)
    for i, (state, token, p) in enumerate(zip(states, tokens, positions)):  # inline: B rows every propose
        if type(state) is not MtpProposerState or state.owner != owner or state.is_freed:
            return None
        if type(token) is not int or not 0 <= token < vocab:
            return None
        if type(p) is not int or not 0 <= p < first_too_far or p + num_drafts > state.max_positions:
            return None
        table, kv_start = state.table, state.kv_start
        if table.pass_mark == serial:  # a table two rows share: the general path refuses it
            return None
        table.pass_mark = serial
        if not 0 <= kv_start <= p <= state.seq_len:
            if kv_start <= p <= state.seq_len:  # continuing rows from a kv_start < 0: refused
                return None
            kv_start = p  # a propose that does not continue the rows starts them afresh at p
        blocks, j = table.blocks, p // bs
        if table.block_size != bs:
            return None
        try:  # held: as PagedLatentCache._unheld_rows (design note "held rows")
            block = blocks[j]
            if block < 0 or block_states[block] != OWNED or table.cache_id != cache_id or (
                    (last := (p + span) // bs) != j
                    and (last - j > 1 or (other := blocks[last]) < 0 or block_states[other] != OWNED)):
                unheld.append(i)
                continue
        except IndexError:
            unheld.append(i)
            continue
        # as MetadataWriter.write_rows_at (the bytes are tested equal)
        pack(mem, i * row_bytes, p, block * bs + p % bs, p + 1, kv_start)
        oldest = p - window + 1
        lo = (kv_start if kv_start > oldest else oldest) // bs
        record = written[i]
        if record is None or record[0] != lo or record[1] != blocks[lo:]:
            # A table that moved (or was never staged here): only then its length and type
            # are checked, since any change to them changes the staged entries.
            if type(blocks) is not list or len(blocks) > max_blocks:
                return None
            writer.write_table(i, lo, blocks[lo:])
    return unheld if len(states) == len(tokens) else None
