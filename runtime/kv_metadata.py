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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.errors import CacheError, InputError, describe

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
    checked = [None if row is None else _checked_row(i, row, max_blocks_per_seq) for i, row in enumerate(rows)]
    # Built in place on the host (pinned staging buffers are), else on the host and copied in one go.
    target = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=torch.uint8)
    view = MetadataView.of(target, max_blocks_per_seq)
    target.zero_()
    view.buf.view(torch.int32)[:, BLOCK_TABLE_OFFSET // 4 :] = -1
    view.slot.fill_(-1)
    view.kv_start.fill_(1)
    for i, row in enumerate(checked):
        if row is None:
            continue
        pos, kv_start, blocks, block_size = row
        view.pos[i] = pos
        view.slot[i] = blocks[pos // block_size] * block_size + pos % block_size
        view.seq_len[i] = pos + 1
        view.kv_start[i] = kv_start
        lo = 0 if window is None else max(kv_start, pos - window + 1, 0) // block_size
        if len(blocks) > lo:
            view.block_table[i, lo : len(blocks)] = torch.tensor(blocks[lo:], dtype=torch.int32)
    if target is not out:
        out.copy_(target)
    return out


def _checked_row(i: int, row, max_blocks_per_seq: int) -> tuple[int, int, list[int], int]:
    pos, kv_start, table = row
    blocks = list(getattr(table, "blocks", table))
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
    block_size = getattr(table, "block_size", 16)
    j = pos // block_size
    if j >= len(blocks) or blocks[j] < 0:
        raise CacheError(
            describe(
                f"metadata row {i} position {pos}",
                "an allocated block",
                f"table {blocks}",
                "call cache.ensure() before packing",
            )
        )
    return pos, kv_start, blocks, block_size
