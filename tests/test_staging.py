"""Staging with array writes: every byte a chain reads is the one a from-scratch pack would write.

Design note "window columns" (runtime/cache/metadata.py): a row's block-table entries outside
the blocks its steps read may hold anything. The oracle here says what each step reads
(positions p - window + 1 .. p + span, the attention's own rule) and the test checks exactly
those entries, and every other field, after random call sequences that move rows between
live and dead, reuse rows for other sequences, and change tokens, masks and hiddens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from draftgraph.runtime.cache.metadata import MetadataView, window_columns
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.ir.tensor_spec import TensorSpec

BLOCK, MAX_BLOCKS = 16, 40


def staging(bucket: int, window: int, span: int) -> ChainStaging:
    return ChainStaging(bucket, TensorSpec(("B", 2, 3), torch.bfloat16), MAX_BLOCKS, 3, torch.device("cpu"),
                        window=window, span=span)


def random_tables(rng: random.Random, count: int) -> np.ndarray:
    """Tables with -1 before a trimmed front and here and there, block ids elsewhere."""
    tables = np.full((count, MAX_BLOCKS), -1, dtype=np.int32)
    for row in tables:
        lo, hi = sorted(rng.sample(range(MAX_BLOCKS + 1), 2))
        row[lo:hi] = [rng.randrange(0, 500) for _ in range(hi - lo)]
    return tables


def read_entries(window: int, span: int, pos: int) -> range:
    """The table entries a chain row at ``pos`` reads: positions pos - window + 1 .. pos + span."""
    return range(max(pos - window + 1, 0) // BLOCK, min((pos + span) // BLOCK, MAX_BLOCKS - 1) + 1)


def check_batch(st: ChainStaging, tables, which, pos, kv, tokens, window, span, limit, masks) -> None:
    view = MetadataView.of(st.host_buf[: st.bucket * st.row_bytes].view(st.bucket, -1), MAX_BLOCKS)
    n = len(pos)
    for i in range(st.bucket):
        if i < n:
            table, p = tables[which[i]], int(pos[i])
            block = int(table[p // BLOCK])
            assert view.pos[i] == p and view.seq_len[i] == p + 1 and view.kv_start[i] == kv[i]
            assert view.slot[i] == (block * BLOCK + p % BLOCK if block >= 0 else -1)
            for j in read_entries(window, span, p):
                assert view.block_table[i, j] == table[j], (i, p, j)
        else:  # a dead row: no slot of its own at any step (positions 0 .. span)
            assert (view.pos[i], view.slot[i], view.seq_len[i], view.kv_start[i]) == (0, -1, 0, 1)
            for j in read_entries(window, span, span):
                assert view.block_table[i, j] == -1
    assert st.views["token"][:n].tolist() == list(tokens) and not st.views["token"][n:].any()
    assert st.views["vocab_limit"].item() == limit
    want = np.full((st.bucket, 3), -1, dtype=np.int32)
    for i, mask in enumerate(masks or []):
        if mask is not None:
            want[i, : len(mask)] = mask
    assert (st.masks == want).all()


@pytest.mark.parametrize("window,span", [(16, 0), (40, 7), (128, 3)])
@pytest.mark.parametrize("bucket", [1, 4, 8])
def test_random_batches_stage_what_each_step_reads(bucket, window, span):
    rng = random.Random(bucket * 1000 + window + span)
    st = staging(bucket, window, span)
    for _ in range(60):
        tables = random_tables(rng, 6)
        n = rng.randrange(0, bucket + 1)
        which = np.array([rng.randrange(6) for _ in range(n)], dtype=np.int64)
        pos = np.array([rng.randrange(0, (MAX_BLOCKS - 1) * BLOCK - span) for _ in range(n)], dtype=np.int64)
        kv = np.array([rng.randrange(0, p + 1) for p in pos], dtype=np.int64)
        tokens = np.array([rng.randrange(100) for _ in range(n)], dtype=np.int64)
        masks = [rng.choice([None, [rng.randrange(1 << 31) for _ in range(rng.randrange(1, 4))]]) for _ in range(n)]
        masks = masks if rng.random() < 0.5 else None
        limit = rng.randrange(1, 100)
        st.stage(tables, which, pos, kv, tokens, torch.zeros(n, 2, 3, dtype=torch.bfloat16), limit, masks)
        check_batch(st, tables, which, pos, kv, tokens, window, span, limit, masks)


def test_the_window_columns_cover_every_read_entry_up_to_the_tables_end():
    for window in (1, 16, 17, 128):
        for span in (0, 1, 7, 15):
            columns = window_columns(window, span, BLOCK, MAX_BLOCKS)
            for pos in range(0, MAX_BLOCKS * BLOCK - span):
                lo = min(max(pos - window + 1, 0) // BLOCK, MAX_BLOCKS - columns)
                assert set(read_entries(window, span, pos)) <= set(range(lo, lo + columns)), (window, span, pos)


def test_hiddens_are_copied_and_stale_rows_zeroed_on_the_cpu():
    st = staging(4, 16, 0)
    tables = np.zeros((1, MAX_BLOCKS), dtype=np.int32)
    block = torch.randn(3, 2, 3).bfloat16()
    st.stage(tables, np.zeros(3, dtype=np.int64), np.array([0, 1, 2]), np.zeros(3, dtype=np.int64),
             np.arange(3), block, 10)
    assert torch.equal(st.hidden_buf[:3], block) and not st.hidden_buf[3].any()
    rows = [torch.randn(2, 3).bfloat16()]
    st.stage(tables, np.zeros(1, dtype=np.int64), np.array([5]), np.zeros(1, dtype=np.int64), np.arange(1), rows, 10)
    assert torch.equal(st.hidden_buf[0], rows[0]) and not st.hidden_buf[1:].any()
    assert st.device_buf is st.host_buf  # the CPU: the graph reads the host buffer, no copy
