"""Catch-up rows: the drafter rows a verify's accepted tokens owe, checked and placed before any run.

After a verify accepts ``a`` drafts of a propose at ``p``, the drafter rows p .. p+a must be
written again from the target's own hiddens [h_p .. h_{p+a}] paired with [t, d_1 .. d_a]
(decode/loop.py). Two calls write them: ``catchup_batch`` in drafter-prefill runs of their own,
and ``propose_device(..., catchup=...)`` in the first step of the next chain (design note
"catch-up in the first step", proposer/device_propose.py). Both go through this file:

- :func:`check_rows` checks a call's rows, all before any work (and their finiteness, one host
  sync, unless the caller checked it on the device): a :class:`CatchupRows`, or None when no
  sequence has a row;
- :func:`place_rows` maps the rows' blocks and moves each state's seq_len / kv_start past them, all
  or nothing: a :class:`PlacedCatchup`, whose ``undo`` puts both back (a failed or dropped run);
- :func:`write_in_prefill_runs` writes rows in drafter-prefill runs of at most the largest bucket.

Rows of one sequence are consecutive positions; any split of them into runs in position order is
causal (a row reads only positions <= its own, written by the same run or an earlier one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from draftgraph.runtime.errors import InputError, NonFiniteError, describe
from draftgraph.runtime.native import batch_kernel
from draftgraph.runtime.proposer.checks import check_batch, check_hidden_batch, check_ints, check_states


@dataclass
class CatchupRows:
    """The checked rows of a catch-up call, sequence-major, each sequence's rows in position order.

    Only sequences with at least one row are kept: ``index`` says which of the call's they are.
    """

    index: np.ndarray  # int64 [m]: the sequence's index in the call
    rows: np.ndarray  # int64 [m]: its proposer row
    starts: np.ndarray  # int64 [m]: the position of its first row
    count: np.ndarray  # int64 [m]: its number of rows (>= 1)
    tokens: np.ndarray  # int64 [N]: every row's token
    hidden: torch.Tensor  # [N, ...]: every row's hidden

    @property
    def num_rows(self) -> int:
        return int(self.count.sum())

    def positions(self) -> np.ndarray:
        """int64 [N]: every row's position."""
        return np.concatenate([np.arange(s, s + c, dtype=np.int64)
                               for s, c in zip(self.starts.tolist(), self.count.tolist())])

    def which(self) -> np.ndarray:
        """int64 [N]: every row's proposer row (its block table)."""
        return np.repeat(self.rows, self.count)


@dataclass
class PlacedCatchup:
    """What :func:`place_rows` changed: the states' old seq_len / kv_start and the blocks it mapped."""

    rows: np.ndarray  # int64 [m]
    row_kv: np.ndarray  # int64 [N]: each row's kv_start (its state's from here on)
    old_seq_len: np.ndarray
    old_kv_start: np.ndarray
    tables: list  # the m BlockTables
    mapped: list[list[int]]  # the block ids mapped into each

    def undo(self, prop) -> None:
        """Give the mapped blocks back and the states their old lengths (the rows never happened)."""
        for table, ids in zip(self.tables, self.mapped):
            if ids:
                prop.cache.unmap(table, ids)
        prop.rows.seq_len[self.rows], prop.rows.kv_start[self.rows] = self.old_seq_len, self.old_kv_start


def check_rows(prop, tokens: Sequence[Sequence[int]], hiddens, first_pos: Sequence[int], states,
               assume_finite: bool = False) -> CatchupRows | None:
    """Check a catch-up of ``len(tokens)`` sequences (``hiddens[i]`` [n_i, ...] pairs ``tokens[i]``).

    Raises InputError for the first bad item and NonFiniteError for a NaN or an infinity in a
    hidden (one host sync; none with ``assume_finite``). None when no sequence has a row.
    """
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise InputError(describe("tokens", "one sequence of token ids per state", type(tokens).__name__))
    n = len(tokens)
    check_batch("hiddens", hiddens, n)
    rows = check_states(states, prop.id, prop.rows, n) & batch_kernel.ROW_MASK
    starts = check_ints(first_pos, "first_pos", 0, prop.max_seq_len, n)
    counts, toks, blocks = [], [], []
    for i in range(n):
        check_batch(f"tokens[{i}]", tokens[i], len(tokens[i]) if hasattr(tokens[i], "__len__") else -1)
        tok = check_ints(tokens[i], "catch-up tokens", 0, prop.config.vocab_size, len(tokens[i]))
        if not isinstance(hiddens[i], torch.Tensor):
            raise InputError(describe("catch-up hiddens", f"one tensor [{len(tok)}, ...] per sequence",
                                      type(hiddens[i]).__name__, "torch.stack a list of hiddens"))
        blocks.append(check_hidden_batch(hiddens[i], prop._hidden_shape, prop.device, len(tok), "catch-up hiddens"))
        counts.append(len(tok))
        toks.append(tok)
    count = np.array(counts, dtype=np.int64)
    prop._check_budget(rows, starts, count, "first_pos", "rows")
    live = np.flatnonzero(count > 0)
    if not len(live):
        return None
    kept = [blocks[i] for i in live.tolist()]
    hidden = kept[0] if len(kept) == 1 else torch.cat(kept)
    if not assume_finite and not bool(torch.isfinite(hidden).all()):  # the one sync: nothing mapped yet
        raise NonFiniteError(describe("catch-up hiddens", "finite values", "a NaN or an infinity",
                                      "the call is refused: no state or cache row changed"))
    return CatchupRows(live.astype(np.int64), rows[live], starts[live], count[live],
                       np.concatenate([toks[i] for i in live.tolist()]), hidden)


def place_rows(prop, rows: CatchupRows) -> PlacedCatchup:
    """Map the rows' blocks and move each state past its rows (all or nothing; CacheError when short).

    A state's kv_start stays where its rows continue its valid rows (kv_start <= first <= seq_len),
    and moves to the first row where they jump ahead or back, as a propose's does.
    """
    seq_len, kv_start = prop.rows.seq_len[rows.rows], prop.rows.kv_start[rows.rows]
    kv = np.where((rows.starts > seq_len) | (rows.starts < kv_start), rows.starts, kv_start)
    tables = [prop.rows.table_of[r] for r in rows.rows.tolist()]
    mapped = prop.cache.ensure_batch(tables, rows.starts.tolist(), (rows.starts + rows.count - 1).tolist())
    placed = PlacedCatchup(rows.rows, np.repeat(kv, rows.count), seq_len.copy(), kv_start.copy(), tables, mapped)
    prop.rows.kv_start[rows.rows], prop.rows.seq_len[rows.rows] = kv, rows.starts + rows.count
    return placed


def write_in_prefill_runs(prop, which: np.ndarray, pos: np.ndarray, kv: np.ndarray, tokens: np.ndarray,
                          hidden: torch.Tensor) -> None:
    """Write these rows in drafter-prefill runs of at most the largest bucket, in their order."""
    chunk = prop.buckets[-1]
    for at in range(0, len(pos), chunk):
        part = slice(at, at + chunk)
        bucket = prop._bucket(len(pos[part]))
        staged = prop._staging_for(bucket).stage(prop.rows.tables, which[part], pos[part], kv[part], tokens[part],
                                                 hidden[part], prop._vocab_limit())
        prop._prefill_executor(bucket).run(
            {k: staged[k] for k in ("token", "hidden", "positions", "kv_start", "block_table")}, check=False)
