"""Incremental staging writes exactly the bytes a from-scratch pack writes (the oracle below).

The oracle is the packer as it was before staging became incremental: every call zeroes the
buffer and writes every field with torch ops. Random call sequences move rows between live
and padding, grow and trim long tables, change windows, masks, tokens and hiddens.
"""

from __future__ import annotations

import random

import pytest
import torch
from draftgraph.runtime.cache.metadata import (
    BLOCK_TABLE_OFFSET,
    MetadataView,
    MetadataWriter,
    check_rows,
    pack_metadata,
)
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.errors import CacheError, InputError
from draftgraph.runtime.ir.tensor_spec import TensorSpec

BLOCK = 16


def oracle_metadata(rows, max_blocks: int, width: int, batch: int, window) -> torch.Tensor:
    out = torch.zeros(batch, width, dtype=torch.uint8)
    view = MetadataView.of(out, max_blocks)
    view.buf.view(torch.int32)[:, BLOCK_TABLE_OFFSET // 4 :] = -1
    view.slot.fill_(-1)
    view.kv_start.fill_(1)
    for i, row in enumerate(rows):
        if row is None:
            continue
        pos, kv_start, blocks = row
        view.pos[i] = pos
        view.slot[i] = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
        view.seq_len[i] = pos + 1
        view.kv_start[i] = kv_start
        lo = 0 if window is None else max(kv_start, pos - window + 1, 0) // BLOCK
        if len(blocks) > lo:
            view.block_table[i, lo : len(blocks)] = torch.tensor(blocks[lo:], dtype=torch.int32)
    return out


def oracle_stage(staging: ChainStaging, rows, tokens, vocab_limit, masks) -> torch.Tensor:
    """The whole host buffer as the old ``stage`` left it."""
    buf = torch.zeros_like(staging.host_buf)
    b = staging.bucket
    meta = oracle_metadata(list(rows) + [None] * (b - len(rows)), staging.max_blocks, staging._row, b,
                           staging.window)
    buf[: meta.numel()] = meta.reshape(-1)
    views = staging._views(buf)
    views["token"][: len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    views["vocab_limit"].fill_(int(vocab_limit))
    views["grammar_mask"].fill_(-1)
    for i, mask in enumerate(masks or []):
        if mask is not None:
            words = torch.as_tensor(mask, dtype=torch.int32)
            views["grammar_mask"][i, : words.numel()] = words
    return buf


def random_row(rng: random.Random, max_blocks: int):
    """(pos, kv_start, blocks): a long or short table with -1 before a window, sometimes holes."""
    pos = rng.randrange(0, (max_blocks - 1) * BLOCK)
    kv_start = rng.choice([0, pos, rng.randrange(0, pos + 1)])
    blocks = [rng.randrange(0, 500) for _ in range(pos // BLOCK + 1 + rng.randrange(0, 2))]
    trimmed = rng.randrange(0, pos // BLOCK + 1)
    blocks[:trimmed] = [-1] * trimmed
    if rng.random() < 0.2 and len(blocks) > 2:
        blocks[rng.randrange(0, len(blocks))] = -1  # a hole (freed block) somewhere
    blocks[pos // BLOCK] = rng.randrange(0, 500)
    return pos, kv_start, blocks


@pytest.mark.parametrize("window", [None, 16, 40])
@pytest.mark.parametrize("bucket", [1, 4, 8])
def test_incremental_stage_bytes_equal_a_fresh_pack(bucket, window):
    rng = random.Random(bucket * 100 + (window or 0))
    max_blocks, mask_words, hidden = 12, 5, TensorSpec(("B", 2, 3), torch.bfloat16)
    staging = ChainStaging(bucket, hidden, max_blocks, mask_words, torch.device("cpu"), window=window)
    keep = None
    for _ in range(60):
        n = rng.randrange(0, bucket + 1)
        rows = [random_row(rng, max_blocks) for _ in range(n)]
        if keep is not None and n and rng.random() < 0.5:  # the same table again, one position on
            pos, kv_start, blocks = keep
            rows[0] = (pos + 1, kv_start, blocks) if (pos + 1) // BLOCK == pos // BLOCK else keep
        padded_rows = [r if rng.random() > 0.2 else None for r in rows]
        tokens = [rng.randrange(0, 1000) for _ in range(n)]
        hiddens = [torch.randn(2, 3).bfloat16() for _ in range(n)]
        masks = None
        if rng.random() < 0.4:
            shared = [rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(1, mask_words + 1))]
            masks = [shared if rng.random() < 0.8 else None for _ in range(n)]
        limit = rng.randrange(1, 1000)
        staging.stage(padded_rows, tokens, hiddens, limit, masks)
        expected = oracle_stage(staging, padded_rows, tokens, limit, masks)
        assert torch.equal(staging.host_buf, expected)
        assert torch.equal(staging.device_buf, expected)
        want_hidden = torch.zeros_like(staging.hidden_buf)
        for i, h in enumerate(hiddens):
            want_hidden[i] = h
        assert torch.equal(staging.hidden_buf, want_hidden)
        keep = rows[0] if rows else None


def test_pack_metadata_equals_the_oracle_for_long_tables_and_windows():
    rng = random.Random(7)
    for window in (None, 16, 100):
        rows = [random_row(rng, 300) if rng.random() > 0.3 else None for _ in range(9)]
        got = pack_metadata(rows, 300, window=window)
        width = got.shape[1]
        want = oracle_metadata([None if r is None else r for r in rows], 300, width, 9, window)
        assert torch.equal(got, want)
        # Into a non-contiguous out (rows of a wider buffer): built aside, copied in.
        wide = torch.full((9, width + 64), 7, dtype=torch.uint8)
        pack_metadata(rows, 300, out=wide[:, :width], window=window)
        assert torch.equal(wide[:, :width], want) and bool((wide[:, width:] == 7).all())


def test_bad_row_changes_no_staged_byte():
    staging = ChainStaging(4, TensorSpec(("B", 2), torch.bfloat16), 6, 2, torch.device("cpu"), window=16)
    staging.stage([(20, 0, [3, 4])], [5], [torch.ones(2).bfloat16()], 50)
    before = (staging.host_buf.clone(), staging.device_buf.clone(), staging.hidden_buf.clone())
    for rows, error in (([(20, 0, [3, 4]), (40, 0, [1, 2])], CacheError),  # pos 40 has no block
                        ([(20, 21, [3, 4])], InputError),  # kv_start > pos
                        ([(20, 0, [1] * 7)], InputError),  # longer than max_blocks_per_seq
                        ([(1, 0, [1])] * 5, InputError)):  # more rows than the bucket
        with pytest.raises(error):
            staging.stage(rows, [1] * len(rows), [], 9)
        after = (staging.host_buf, staging.device_buf, staging.hidden_buf)
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_writer_reset_after_a_foreign_write():
    buf = torch.zeros(2, 320, dtype=torch.uint8)
    writer = MetadataWriter(buf, 5, window=None)
    rows = check_rows([(3, 0, [2]), None], 5)
    writer.write(rows)
    buf.fill_(0x5A)  # someone else wrote the buffer: the writer's records are stale until reset
    writer.reset()
    writer.write(rows)
    assert torch.equal(buf, oracle_metadata([(3, 0, [2]), None], 5, 320, 2, None))
    with pytest.raises(InputError, match="contiguous CPU"):
        MetadataWriter(torch.zeros(2, 384, dtype=torch.uint8)[:, :320], 5)
