"""Stage rows given as (position, kv_start, block ids) through ChainStaging's array API (tests only)."""

from __future__ import annotations

import numpy as np


def stage_rows(st, rows, tokens, hiddens, vocab_limit, masks=None, copy_in=True):
    """``st.stage`` of rows ``(pos, kv_start, blocks)``: each row's blocks become its own table."""
    tables = np.full((max(len(rows), 1), st.max_blocks), -1, dtype=np.int32)
    for i, (_, _, blocks) in enumerate(rows):
        tables[i, : len(blocks)] = blocks
    column = lambda j: np.array([r[j] for r in rows], dtype=np.int64)  # noqa: E731
    return st.stage(tables, np.arange(len(rows), dtype=np.int64), column(0), column(1),
                    np.array(tokens, dtype=np.int64), hiddens, vocab_limit, masks, copy_in)
