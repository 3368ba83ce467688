"""Decode metadata of the MTP attention, packed one uint8 row per sequence (the seed's layout).

Row layout (little-endian, byte offsets)::

    0    pos        int64   position written and attended from
    8    slot       int64   kv row of pos (-1: a dead row writes nothing)
    16   seq_len    int32   pos + 1 (0 on a dead row)
    20   kv_start   int32   first valid key position: keys are max(kv_start, pos - window + 1)..pos
    256  block_table int32[max_blocks_per_seq]

``row_bytes = 256 + 4 * max_blocks_per_seq`` rounded up to 64. Because every field is a view
of one uint8 buffer, a single host-to-device copy stages a whole batch, and a captured graph
can advance ``pos`` / ``slot`` / ``seq_len`` on the device through the same views.

Design note "window columns": the attention reads a row's table only at the positions
p - window + 1 .. p of each step, so a chain of K steps reads the blocks of p - window + 1 ..
p + K - 1: ``window_columns`` entries from ``(p - window + 1) // block_size``. Those are the
only entries a stage writes (~10 of the thousands a long table has: native/batch_kernel.py's
``write``); the others keep whatever an earlier row left there, which no kernel reads. A dead
(padded) row: pos 0, slot -1, seq_len 0, kv_start 1 (> pos, so no key is read) and its window
columns -1, so its own slot does not exist and it writes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from draftgraph.runtime.errors import InputError, describe

POS_OFFSET, SLOT_OFFSET, SEQ_LEN_OFFSET, KV_START_OFFSET, BLOCK_TABLE_OFFSET = 0, 8, 16, 20, 256
ROW_ALIGN = 64


def max_blocks_for(max_seq_len: int, block_size: int = 16) -> int:
    """Block-table entries a sequence may need: ceil(max_seq_len / block_size) + 1."""
    return math.ceil(max_seq_len / block_size) + 1


def row_bytes_for(max_blocks_per_seq: int) -> int:
    """Bytes of one metadata row: 256 + 4 * max_blocks_per_seq, rounded up to 64."""
    raw = BLOCK_TABLE_OFFSET + 4 * max_blocks_per_seq
    return -(-raw // ROW_ALIGN) * ROW_ALIGN


def window_columns(window: int, span: int, block_size: int, max_blocks: int) -> int:
    """Table entries a row's steps read: the blocks of p - window + 1 .. p + span (design note above)."""
    return min((window + span - 2) // block_size + 2, max_blocks)


@dataclass(frozen=True)
class MetadataView:
    """Named torch views into a packed metadata buffer ``buf`` uint8 [B, row_bytes].

    Every field shares ``buf``'s storage: writing ``view.pos[i]`` writes the buffer. The
    graph's inputs are such views of the device buffer.
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
            raise InputError(describe("metadata buffer", f"uint8 [B, row_bytes], row_bytes a multiple of {ROW_ALIGN}",
                                      f"{buf.dtype}{list(buf.shape)} strides {buf.stride()}"))
        capacity = (buf.shape[1] - BLOCK_TABLE_OFFSET) // 4
        num = capacity if max_blocks_per_seq is None else max_blocks_per_seq
        if not 0 <= num <= capacity:
            raise InputError(describe("max_blocks_per_seq", f"0..{capacity} for rows of {buf.shape[1]} bytes", num))
        as64, as32 = buf.view(torch.int64), buf.view(torch.int32)
        bt = BLOCK_TABLE_OFFSET // 4
        return MetadataView(buf=buf, pos=as64[:, POS_OFFSET // 8], slot=as64[:, SLOT_OFFSET // 8],
                            seq_len=as32[:, SEQ_LEN_OFFSET // 4], kv_start=as32[:, KV_START_OFFSET // 4],
                            block_table=as32[:, bt : bt + num])
