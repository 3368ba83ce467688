"""Catch-up rows: the drafter rows a verify's accepted tokens owe, checked and placed before any run.

After a verify accepts ``a`` drafts of a propose at ``p``, the drafter rows p .. p+a must be
written again from the target's own hiddens [h_p .. h_{p+a}] paired with [t, d_1 .. d_a]
(decode/loop.py). Two calls write them: ``catchup_batch`` in drafter-prefill runs of their own,
and ``propose_device(..., catchup=...)`` in the first step of the next chain (design note
"catch-up in the first step", proposer/device_propose.py). Both go through this file:

- :func:`check_rows` checks a call's rows, all before any work (and their finiteness, one host
  sync, unless the caller checked it on the device): a :class:`CatchupRows`, or None when no
  sequence has a row;
- :func:`usual_rows` is check_rows' fast path for a decode loop's usual call (design note "checks
  the kernel makes", below);
- :func:`place_rows` maps the rows' blocks and moves each state's seq_len / kv_start past them, all
  or nothing: a :class:`PlacedCatchup`, whose ``undo`` puts both back (a failed or dropped run);
- :func:`write_in_prefill_runs` writes rows in drafter-prefill runs of at most the largest bucket.

Rows of one sequence are consecutive positions; any split of them into runs in position order is
causal (a row reads only positions <= its own, written by the same run or an earlier one).

Design note "checks the kernel makes": a decode loop calls ``propose_device(..., catchup=)`` every
step, and check_rows' item checks were a third of the host time from the verdict to the next
launch (33 of 160 us at B=1 on the CPU harness, benchmarks/bench_loop_host.py). Most of them
repeat what ``place_rows``' one batch-kernel call checks anyway (live distinct keys, position
ranges, budgets, all before it maps anything). :func:`usual_rows` takes the usual call (lists of
plain ints, one HiddenRows) with only the checks the kernel does not make (token ids, the
hiddens' buffer and index); when the kernel then refuses, ``place_rows``' ``recheck`` runs
check_rows in full for the typed error of the first bad item, as before. Anything unusual goes
to check_rows directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from draftgraph.runtime.cache.hidden_rows import HiddenRows, as_tensor
from draftgraph.runtime.errors import CacheError, InputError, NonFiniteError, describe
from draftgraph.runtime.native import batch_kernel
from draftgraph.runtime.proposer.checks import (
    PLAIN_INT_TYPES,
    check_batch,
    check_hidden_batch,
    check_hidden_rows,
    check_ints,
    check_states,
    hidden_rows_ok,
    is_on,
    sequence_length,
)

_FEW = 16  # sequences: below this, per-row work in Python lists beats numpy's per-call cost


@dataclass
class CatchupRows:
    """The checked rows of a catch-up call, sequence-major, each sequence's rows in position order.

    Only sequences with at least one row are kept: ``index`` says which of the call's they are.
    """

    index: np.ndarray  # int64 [m]: the sequence's index in the call
    keys: np.ndarray  # int64 [m]: its state's key (proposer/sequences.py)
    rows: np.ndarray  # int64 [m]: its proposer row
    starts: np.ndarray  # int64 [m]: the position of its first row
    count: np.ndarray  # int64 [m]: its number of rows (>= 1)
    tokens: np.ndarray  # int64 [N]: every row's token
    hidden: torch.Tensor | HiddenRows  # [N, ...]: every row's hidden
    recheck: Callable[[], None] | None = None  # usual_rows': the full checks, for place_rows' refusal

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    def positions(self) -> np.ndarray:
        """int64 [N]: every row's position (row r of sequence j: starts[j] + r - its first row's index)."""
        if len(self.count) <= _FEW:  # a decode step's: ranges joined in Python, cheaper than five numpy calls
            return np.array([p for s, c in zip(self.starts.tolist(), self.count.tolist()) for p in range(s, s + c)],
                            dtype=np.int64)
        first_row = np.cumsum(self.count) - self.count
        return np.arange(self.num_rows, dtype=np.int64) + np.repeat(self.starts - first_row, self.count)

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
    mapped: np.ndarray  # int64 [b, 2]: the (row, table entry) of every block it mapped

    def undo(self, prop) -> None:
        """Give the mapped blocks back and the states their old lengths (the rows never happened)."""
        if len(self.mapped):
            prop._unmap(self.mapped)
        prop.rows.seq_len[self.rows], prop.rows.kv_start[self.rows] = self.old_seq_len, self.old_kv_start


def check_rows(prop, tokens: Sequence[Sequence[int]], hiddens, first_pos: Sequence[int], states,
               assume_finite: bool = False, keys: np.ndarray | None = None) -> CatchupRows | None:
    """Check a catch-up of ``len(tokens)`` sequences (``hiddens[i]`` [n_i, ...] pairs ``tokens[i]``; or
    ``hiddens`` one HiddenRows of every row, sequence after sequence).

    Raises InputError for the first bad item and NonFiniteError for a NaN or an infinity in a
    hidden (one host sync; none with ``assume_finite``). None when no sequence has a row.
    ``keys``: the states' keys, as a propose of the same states made them (not yet checked).
    """
    n = sequence_length(tokens)
    if n is None:
        raise InputError(describe("tokens", "one sequence of token ids per state", type(tokens).__name__))
    as_rows = isinstance(hiddens, HiddenRows)
    if not as_rows:
        check_batch("hiddens", hiddens, n)
    if keys is None or len(keys) != n or batch_kernel.check_keys(keys, keys & batch_kernel.ROW_MASK,
                                                                  prop.rows.key)[0] != batch_kernel.OK:
        keys = check_states(states, prop.id, prop.rows, n)  # the typed error of the first bad state
    rows = keys & batch_kernel.ROW_MASK
    starts = check_ints(first_pos, "first_pos", 0, prop.max_seq_len, n)
    regular = _regular_rows(prop, tokens, None if as_rows else hiddens)
    if regular is not None:  # the usual call (a decode loop's): a few batch-wide tests, no loop of checks
        counts, flat, blocks = regular
    else:  # item by item: the typed error of the first bad item, or rows of other types converted
        counts, toks, blocks = [], [], []
        for i in range(n):
            length = sequence_length(tokens[i])
            check_batch(f"tokens[{i}]", tokens[i], -1 if length is None else length)
            tok = check_ints(tokens[i], "catch-up tokens", 0, prop.config.vocab_size, length)
            counts.append(len(tok))
            toks.append(tok)
            if as_rows:
                continue
            if not isinstance(hiddens[i], torch.Tensor):
                raise InputError(describe("catch-up hiddens", f"one tensor [{len(tok)}, ...] per sequence",
                                          type(hiddens[i]).__name__, "torch.stack a list of hiddens"))
            blocks.append(check_hidden_batch(hiddens[i], prop._hidden_shape, prop.device, len(tok),
                                             "catch-up hiddens"))
        flat = np.concatenate(toks) if toks else np.zeros(0, dtype=np.int64)
    if as_rows:
        hiddens = check_hidden_rows(hiddens, prop._hidden_shape, prop.device, sum(counts), "catch-up hiddens")
    count = np.array(counts, dtype=np.int64)
    prop._check_budget(rows, starts, count, "first_pos", "rows")
    if min(counts, default=0) > 0:  # every sequence has rows
        live, kept = np.arange(n, dtype=np.int64), blocks
    else:
        live = np.flatnonzero(count > 0)
        if not len(live):
            return None
        kept = [blocks[i] for i in live.tolist()]
    hidden = hiddens if as_rows else kept[0] if len(kept) == 1 else torch.cat(kept)
    if not assume_finite and not bool(torch.isfinite(as_tensor(hidden)).all()):  # one sync
        raise NonFiniteError(describe("catch-up hiddens", "finite values", "a NaN or an infinity",
                                      "the call is refused: no state or cache row changed"))
    return CatchupRows(live, keys[live], rows[live], starts[live], count[live], flat, hidden)


def usual_rows(prop, tokens, hiddens, first_pos, keys: np.ndarray) -> CatchupRows | None:
    """A decode loop's usual catch-up (every sequence with rows: lists of plain ints in the vocabulary,
    one HiddenRows of a contiguous bf16 buffer, plain int first positions) checked for what the batch
    kernel's place does not check (design note "checks the kernel makes"); None for anything else.
    ``keys``: the states' keys as the propose made them (checked by place_rows' kernel call)."""
    n = len(keys)
    if type(hiddens) is not HiddenRows or type(first_pos) is not list or type(tokens) is not list \
            or len(first_pos) != n or len(tokens) != n:
        return None
    regular = _regular_rows(prop, tokens, None)
    if regular is None or not set(map(type, first_pos)) <= PLAIN_INT_TYPES:
        return None
    counts, flat, _ = regular
    if not n or min(counts) < 1 or not hidden_rows_ok(hiddens, prop._hidden_shape, prop.device, len(flat)):
        return None
    if max(map(abs, first_pos)) >= 1 << 62:  # past int64 (the checks name it)
        return None
    return CatchupRows(np.arange(n, dtype=np.int64), keys, keys & batch_kernel.ROW_MASK,
                       np.array(first_pos, dtype=np.int64), np.array(counts, dtype=np.int64), flat, hiddens)


def _regular_rows(prop, tokens, hiddens) -> tuple[list[int], np.ndarray, list[torch.Tensor]] | None:
    """(counts, every token, hiddens) of rows that need no conversion and pass every check: lists of
    ints in the vocabulary, each with one bf16 hidden [n_i, ...] on the proposer's device (hiddens
    None: the tokens only). None for anything else (the item-by-item checks then raise or convert)."""
    if type(tokens) is not list or (hiddens is not None and type(hiddens) is not list):
        return None
    counts = [len(t) if type(t) is list else -1 for t in tokens]
    flat = [v for t in tokens if type(t) is list for v in t]
    if -1 in counts or not set(map(type, flat)) <= PLAIN_INT_TYPES:
        return None
    if flat and (min(flat) < 0 or max(flat) >= prop.config.vocab_size):
        return None
    shape, device, bf16 = prop._hidden_shape, prop.device, torch.bfloat16
    for hidden, count in zip(hiddens or (), counts):
        if type(hidden) is not torch.Tensor or hidden.dtype is not bf16 or hidden.shape[1:] != shape \
                or hidden.shape[0] != count or not is_on(hidden, device):
            return None
    return counts, np.array(flat, dtype=np.int64), hiddens


def place_rows(prop, rows: CatchupRows) -> PlacedCatchup:
    """Map the rows' blocks and move each state past its rows (all or nothing; CacheError when short).

    ``rows.recheck`` (rows from :func:`usual_rows`, whose key, position and budget checks are the
    kernel's) runs when the kernel refuses the rows for anything but the pool: it raises the typed
    error of the first bad item; nothing was mapped.

    A state's kv_start stays where its rows continue its valid rows (kv_start <= first <= seq_len),
    and moves to the first row where they jump ahead or back, as a propose's does: one call of
    the batch kernel's ``place`` (design note "flat kernel"), each sequence's rows its span.
    """
    at, m = rows.rows, len(rows.rows)
    old_seq_len, old_kv_start = prop.rows.seq_len[at], prop.rows.kv_start[at]
    kv = np.empty(m, dtype=np.int64)
    # A span of c rows touches at most c // block_size + 2 blocks: room for every pair it may map.
    room = 2 * (rows.num_rows // prop.cache.block_size + 2 * m)
    mapped_out = prop._mapped if room <= len(prop._mapped) else np.zeros(room, dtype=np.int64)
    no_tokens = np.zeros(m, dtype=np.int64)  # the kernel checks a token a row; the rows' own are checked
    with prop.cache.lock:
        status, needed, count = prop._kernel.place(prop._bound(), rows.keys, no_tokens, rows.starts, rows.count, kv,
                                                   mapped_out)
    if status == batch_kernel.POOL:
        cache = prop.cache
        raise CacheError(describe(f"MTP cache blocks for {m} sequences", f"{needed} free block(s)",
                                  f"{cache.num_free_blocks} free of {cache.num_blocks}",
                                  "free finished sequences, call trim_window, or size the pool larger"))
    if status != batch_kernel.OK:
        if rows.recheck is not None:
            rows.recheck()
        raise AssertionError(f"the batch kernel refused (status {status}, row {needed}) checked catch-up rows")
    mapped = mapped_out[: 2 * count].reshape(count, 2).copy()
    for row in set(mapped[:, 0].tolist()):
        prop.rows.table_of[row].cache_id = prop.cache.cache_id
    prop.rows.kv_start[at], prop.rows.seq_len[at] = kv, rows.starts + rows.count
    return PlacedCatchup(at, np.repeat(kv, rows.count), old_seq_len, old_kv_start, mapped)


def rows_of(hidden: torch.Tensor | HiddenRows, rows: slice) -> torch.Tensor | HiddenRows:
    """Rows ``rows`` of a block of hiddens, in its own form."""
    return hidden.take(rows) if isinstance(hidden, HiddenRows) else hidden[rows]


def joined(first, second: torch.Tensor | HiddenRows, shape: tuple[int, ...]) -> torch.Tensor | HiddenRows:
    """``first``'s rows then ``second``'s as one block: rows of one buffer stay rows of it (indexes
    joined, no device work); anything else one tensor. ``first`` may also be a list of row tensors."""
    if isinstance(first, HiddenRows) and isinstance(second, HiddenRows) and first.tensor is second.tensor:
        return HiddenRows(first.tensor, np.concatenate([first.index, second.index]))
    parts = [first if isinstance(first, list) else as_tensor(first), as_tensor(second)]
    if not isinstance(parts[0], torch.Tensor):
        parts[0] = torch.stack([h.reshape(shape) for h in parts[0]])
    return torch.cat(parts)


def write_in_prefill_runs(prop, which: np.ndarray, pos: np.ndarray, kv: np.ndarray, tokens: np.ndarray,
                          hidden: torch.Tensor | HiddenRows) -> None:
    """Write these rows in drafter-prefill runs of at most the largest bucket, in their order."""
    chunk = prop.buckets[-1]
    for at in range(0, len(pos), chunk):
        part = slice(at, at + chunk)
        bucket = prop._bucket(len(pos[part]))
        staged = prop._staging_for(bucket).stage(prop.rows.tables, which[part], pos[part], kv[part], tokens[part],
                                                 rows_of(hidden, part), prop._vocab_limit())
        prop._prefill_executor(bucket).run(
            {k: staged[k] for k in ("token", "hidden", "positions", "kv_start", "block_table")}, check=False)
