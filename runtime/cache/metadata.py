"""Decode metadata of the MTP attention, packed one uint8 row per sequence (the seed's layout).

Row layout (little-endian, byte offsets)::

    0    pos        int64   position written and attended from
    8    slot       int64   kv row of pos (-1: a dead row writes nothing)
    16   seq_len    int32   pos + 1 (0 on a dead row)
    20   kv_start   int32   first valid key position: keys are max(kv_start, pos - window + 1)..pos
    256  block_table int32[max_blocks_per_seq], -1 past the table (and where blocks were freed)

``row_bytes = 256 + 4 * max_blocks_per_seq`` rounded up to 64. Because every field is a view
of one uint8 buffer, a single host-to-device copy stages a whole batch, and a captured graph
can advance ``pos`` / ``slot`` / ``seq_len`` on the device through the same views.

A padded (dead) row: pos 0, slot -1, seq_len 0, kv_start 1 (> pos, so no key is read), block
table all -1.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from draftgraph.runtime.errors import CacheError, InputError, describe

POS_OFFSET, SLOT_OFFSET, SEQ_LEN_OFFSET, KV_START_OFFSET, BLOCK_TABLE_OFFSET = 0, 8, 16, 20, 256
ROW_ALIGN = 64


def max_blocks_for(max_seq_len: int, block_size: int = 16) -> int:
    """Block-table entries a sequence may need: ceil(max_seq_len / block_size) + 1."""
    return math.ceil(max_seq_len / block_size) + 1


def row_bytes_for(max_blocks_per_seq: int) -> int:
    """Bytes of one metadata row: 256 + 4 * max_blocks_per_seq, rounded up to 64."""
    raw = BLOCK_TABLE_OFFSET + 4 * max_blocks_per_seq
    return -(-raw // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class MetadataView:
    """Named views into a packed metadata buffer ``buf`` uint8 [B, row_bytes].

    Every field shares ``buf``'s storage: writing ``view.pos[i]`` writes the buffer.

    Example
    -------
    >>> buf = pack_metadata([(5, 0, [3]), None], max_blocks_per_seq=4)
    >>> view = MetadataView.of(buf)
    >>> view.slot.tolist(), view.kv_start.tolist()
    ([53, -1], [0, 1])
    """

    buf: torch.Tensor  # [B, row_bytes] uint8
    pos: torch.Tensor  # [B] int64
    slot: torch.Tensor  # [B] int64
    seq_len: torch.Tensor  # [B] int32
    kv_start: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32

    @staticmethod
    def of(buf: torch.Tensor, max_blocks_per_seq: int | None = None) -> MetadataView:
        """Views of ``buf``; ``max_blocks_per_seq`` defaults to every entry the row can hold."""
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] % ROW_ALIGN or buf.stride(1) != 1:
            raise InputError(
                describe(
                    "metadata buffer",
                    f"uint8 [B, row_bytes], row_bytes a multiple of {ROW_ALIGN}",
                    f"{buf.dtype}{list(buf.shape)} strides {buf.stride()}",
                )
            )
        capacity = (buf.shape[1] - BLOCK_TABLE_OFFSET) // 4
        num = capacity if max_blocks_per_seq is None else max_blocks_per_seq
        if not 0 <= num <= capacity:
            raise InputError(
                describe("max_blocks_per_seq", f"0..{capacity} for rows of {buf.shape[1]} bytes", num)
            )
        as64, as32 = buf.view(torch.int64), buf.view(torch.int32)
        bt = BLOCK_TABLE_OFFSET // 4
        return MetadataView(
            buf=buf,
            pos=as64[:, POS_OFFSET // 8],
            slot=as64[:, SLOT_OFFSET // 8],
            seq_len=as32[:, SEQ_LEN_OFFSET // 4],
            kv_start=as32[:, KV_START_OFFSET // 4],
            block_table=as32[:, bt : bt + num],
        )

    @property
    def batch(self) -> int:
        return self.buf.shape[0]


Row = tuple[int, int, object] | None  # (pos, kv_start, BlockTable or list of block ids), or padding


def pack_metadata(
    rows: Sequence[Row], max_blocks_per_seq: int, *, out: torch.Tensor | None = None, window: int | None = None
) -> torch.Tensor:
    """Pack decode metadata for a batch into uint8 [B, row_bytes].

    Parameters
    ----------
    rows : per sequence ``(pos, kv_start, table)`` (a BlockTable or a list of block ids; pos
        must have a block) or ``None`` for a padded row.
    max_blocks_per_seq : block-table entries per row (``max_blocks_for(max_seq_len)``).
    out : optional buffer (e.g. pinned, or a capture-stable ``_buf``) with at least len(rows)
        rows of the right width; rows past ``len(rows)`` are written as padding.
    window : when given, block-table entries wholly before ``max(kv_start, pos - window + 1)``
        stay -1: the attention never reads them, and a long sequence's table is thousands of
        entries while its window needs a handful (host time per propose).

    Raises
    ------
    InputError : kv_start outside 0..pos, or a table longer than max_blocks_per_seq.
    CacheError : pos has no allocated block.
    Every row is checked before anything is written, so an error leaves ``out`` as it was.
    """
    width = row_bytes_for(max_blocks_per_seq)
    if out is None:
        out = torch.empty(len(rows), width, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.dim() != 2 or out.shape[1] != width or out.shape[0] < len(rows):
        raise InputError(
            describe("pack_metadata out", f"uint8 [>= {len(rows)}, {width}]", f"{out.dtype}{list(out.shape)}")
        )
    checked = check_rows(rows, max_blocks_per_seq)
    # Built in place on the host (pinned staging buffers are), else on the host and copied in one go.
    in_place = out.device.type == "cpu" and out.is_contiguous()
    target = out if in_place else torch.empty(out.shape, dtype=torch.uint8)
    MetadataWriter(target, max_blocks_per_seq, window).write(checked)
    if target is not out:
        out.copy_(target)
    return out


CheckedRow = tuple[int, int, Sequence[int], int]  # (pos, kv_start, block ids, block_size)


def check_rows(rows: Sequence[Row], max_blocks_per_seq: int) -> list[CheckedRow | None]:
    """Every row of a batch checked (the errors of :func:`pack_metadata`), nothing written."""
    checked: list[CheckedRow | None] = []
    for i, row in enumerate(rows):  # inline, not a call per row: a propose stages B rows each time
        if row is None:
            checked.append(None)
            continue
        pos, kv_start, table = row
        try:  # a BlockTable: plain attribute loads, cheaper than getattr with a default
            blocks, block_size = table.blocks, table.block_size
        except AttributeError:  # a list of block ids
            blocks, block_size = getattr(table, "blocks", table), getattr(table, "block_size", 16)
        if not isinstance(blocks, list):  # a list is only read: no copy of a long table per propose
            blocks = list(blocks)
        if (not 0 <= kv_start <= pos or len(blocks) > max_blocks_per_seq or pos // block_size >= len(blocks)
                or blocks[pos // block_size] < 0):
            _raise_row_error(i, pos, kv_start, blocks, block_size, max_blocks_per_seq)
        checked.append((pos, kv_start, blocks, block_size))
    return checked


def _raise_row_error(i: int, pos: int, kv_start: int, blocks: list[int], block_size: int,
                     max_blocks_per_seq: int) -> None:
    """The error of row ``i``, which failed a check of :func:`check_rows`."""
    if not 0 <= kv_start <= pos:
        raise InputError(describe(f"metadata row {i} kv_start", f"0 <= kv_start <= pos ({pos})", kv_start))
    if len(blocks) > max_blocks_per_seq:
        raise InputError(
            describe(
                f"metadata row {i} block table",
                f"<= {max_blocks_per_seq} entries",
                len(blocks),
                "max_blocks_per_seq comes from max_seq_len",
            )
        )
    raise CacheError(
        describe(
            f"metadata row {i} position {pos}",
            "an allocated block",
            f"table {blocks}",
            "call cache.ensure() before packing",
        )
    )


SCALARS = struct.Struct("<qqii")  # pos, slot, seq_len, kv_start at POS_OFFSET..KV_START_OFFSET + 4
_DEAD_TABLE = None  # a row's record while it is padding: all -1, nothing staged


class MetadataWriter:
    """Writes checked rows into a contiguous CPU metadata buffer, touching only what changed.

    Design note "incremental staging": a propose moves every live row's four scalars, but its
    block-table entries (the window's handful) only every ``block_size`` positions, and padded
    rows stay padding. The writer keeps, per row, the block-table entries it last wrote, and
    writes with ``struct.pack_into`` on the buffer's memory (~0.1 us a field, where a torch
    setitem costs microseconds of dispatch). The bytes are exactly those a fresh
    :func:`pack_metadata` writes. Only the writer may write the buffer (and the one pass of a
    propose, through :meth:`row_sink`); after anything else did, call ``reset()``. ``save`` and
    ``restore`` put back the rows of a batch refused after it was written.
    """

    def __init__(self, buf: torch.Tensor, max_blocks_per_seq: int, window: int | None = None) -> None:
        view = MetadataView.of(buf, max_blocks_per_seq)
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise InputError(describe("MetadataWriter buffer", "a contiguous CPU tensor",
                                      f"{buf.device} strides {buf.stride()}"))
        self.batch, self.max_blocks, self.window = view.batch, max_blocks_per_seq, window
        self._row_bytes = buf.shape[1]
        self._i32 = buf.numpy().view(np.int32)  # [B, row_bytes / 4]
        self._mem = memoryview(buf.numpy().reshape(-1))
        self._tables: list[tuple[int, Sequence[int]] | None] = []
        self._scalars = self._i32[:, : KV_START_OFFSET // 4 + 1]  # [B, 6] int32: pos, slot, seq_len, kv_start
        # What save() copied: every row's scalars (24 bytes a row, as the compiled front copies
        # them) and its table record.
        self._saved_bytes = bytearray(SCALARS.size * self.batch)
        self._saved_scalars = np.frombuffer(self._saved_bytes, dtype=np.int32).reshape(self.batch, -1)
        self._saved_tables: list = []
        self.reset()
        self.save()  # a restore before any save gives the padding back

    def reset(self) -> None:
        """Rewrite every row as padding: pos 0, slot -1, seq_len 0, kv_start 1, table all -1."""
        words = self._i32
        words[:] = 0
        words[:, BLOCK_TABLE_OFFSET // 4 :] = -1
        words[:, SLOT_OFFSET // 4 : SLOT_OFFSET // 4 + 2] = -1  # slot (int64) -1
        words[:, KV_START_OFFSET // 4] = 1
        self._tables[:] = [_DEAD_TABLE] * self.batch  # the same list: the compiled front keeps it

    def write(self, rows: Sequence[CheckedRow | None]) -> None:
        """Rows from :func:`check_rows`; rows past ``len(rows)`` become padding."""
        if len(rows) > self.batch:
            width = self._row_bytes
            raise InputError(describe("pack_metadata out", f"uint8 [>= {len(rows)}, {width}]",
                                      f"torch.uint8[{self.batch}, {width}]"))
        try:
            self.write_rows_at(range(len(rows)), rows)
            self.write_padding_from(len(rows))
        except BaseException:
            self.reset()  # the records may no longer say what the buffer holds
            raise

    def save(self) -> None:
        """Remember what the rows hold now; :meth:`restore` puts it back (a batch refused after writing).

        ~1 us: the rows' scalars (one strided numpy copy) and the list of table records (the
        records are replaced, never changed in place). A propose's compiled front
        (:mod:`draftgraph.runtime.proposer.front`) saves the same into :meth:`save_sink`.
        """
        np.copyto(self._saved_scalars, self._scalars)
        self._saved_tables[:] = self._tables

    def save_sink(self) -> tuple[bytearray, list]:
        """(scalar bytes, table records) that :meth:`restore` reads: for the one other saver, the compiled front."""
        return self._saved_bytes, self._saved_tables

    def restore(self) -> None:
        """The rows as :meth:`save` found them: every scalar, and every block table written since."""
        np.copyto(self._scalars, self._saved_scalars)
        for i, (now, then) in enumerate(zip(self._tables, self._saved_tables)):
            if now is not then:
                if then is _DEAD_TABLE:
                    self._clear_table(i)
                    self._tables[i] = _DEAD_TABLE
                else:
                    self.write_table(i, *then)

    def write_padding_from(self, first: int) -> None:
        """Rows ``first`` .. the end become padding (rows that are padding already cost a check)."""
        for i in range(first, self.batch):
            self._write_dead(i)

    def row_sink(self) -> tuple[memoryview, int, list]:
        """(buffer bytes, row bytes, per-row table records) for the one other writer of rows.

        :mod:`draftgraph.runtime.proposer.front` writes the usual decode batch's rows inline, in the loop that
        checks them (a call per row costs what the pass saves). It writes exactly what
        :meth:`write_rows_at` writes and keeps the records as it does: its Python loop calls
        :meth:`write_table` when a row's staged entries moved, its compiled loop
        (``decode_pass.c``) writes the same bytes and record itself. The equality of the bytes
        is tested on both (``tests/test_decode_pass.py``, ``tests/test_decode_pass_compiled.py``).
        """
        return self._mem, self._row_bytes, self._tables

    def write_rows_at(self, indices: Sequence[int], rows: Sequence[CheckedRow | None]) -> None:
        """Checked rows (from :func:`check_rows`) at rows ``indices`` of the buffer; the others stay."""
        mem, row_bytes, pack, window = self._mem, self._row_bytes, SCALARS.pack_into, self.window
        written = self._tables
        for i, row in zip(indices, rows):  # inline, not a call per row: a propose stages B rows each time
            if row is None:
                self._write_dead(i)
                continue
            pos, kv_start, blocks, block_size = row
            pack(mem, i * row_bytes, pos, blocks[pos // block_size] * block_size + pos % block_size, pos + 1, kv_start)
            if window is None:
                lo = 0
            else:  # max(kv_start, pos - window + 1, 0) // block_size, without the calls (kv_start >= 0: checked)
                oldest = pos - window + 1
                lo = (kv_start if kv_start > oldest else oldest) // block_size
            table = written[i]
            if table is _DEAD_TABLE or table[0] != lo or table[1] != blocks[lo:]:
                self.write_table(i, lo, blocks[lo:])

    def write_table(self, i: int, lo: int, entries: list[int]) -> None:
        """Row ``i``'s block table: ``entries`` from entry ``lo`` on, -1 elsewhere."""
        self._clear_table(i)
        if entries:
            at = i * self._row_bytes + BLOCK_TABLE_OFFSET + 4 * lo
            struct.pack_into(f"<{len(entries)}i", self._mem, at, *entries)
        self._tables[i] = (lo, entries)

    def _write_dead(self, i: int) -> None:
        if self._tables[i] is _DEAD_TABLE:
            return
        SCALARS.pack_into(self._mem, i * self._row_bytes, 0, -1, 0, 1)
        self._clear_table(i)
        self._tables[i] = _DEAD_TABLE

    def _clear_table(self, i: int) -> None:
        written = self._tables[i]
        if written is not _DEAD_TABLE and written[1]:
            lo, entries = written
            at = i * self._row_bytes + BLOCK_TABLE_OFFSET + 4 * lo
            # -1 int32s as bytes on the memoryview: ~0.16 us, where a numpy slice setitem takes ~0.4
            self._mem[at : at + 4 * len(entries)] = b"\xff" * (4 * len(entries))
