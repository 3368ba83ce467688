"""A propose whose drafts stay on the device: the half of a decode loop that never leaves the GPU.

Design note "device drafts": ``propose`` and ``propose_batch`` read the K drafts back and
commit the batch's rows on the host. A decode loop that verifies on the device (the target's
verify graph takes the drafts from a device buffer and computes the acceptance there) needs
neither: :func:`propose_device` runs the same chain on the same executors and returns a
:class:`DeviceDrafts`, whose ``drafts`` are a view of the chain's static output buffer, with
no read-back and no host sync. What the host must know of the drafts to commit the rows is
deferred to :func:`after_verify_device`, which the loop calls with what its one read-back
gave (the accepted counts, and whether the chain dropped the batch for a non-finite hidden):
only then are the rows committed (seq_len, kv_start, verify due) and rolled back to the
accepted drafts, in one call, all or nothing. Until then the batch's states are *placed*:
their blocks for the K drafts are mapped (free_state gives them back), their rows unchanged.

The chain must be ungated (draft_conf_tau 0, or K = 1): a gated chain's kept drafts are a
host decision of the commit. ``drafts`` stays valid until the proposer's next run of the same
(batch bucket, K) chain; the loop copies it into the verify input right away.

Design note "catch-up in the first step": after a verify, the drafter rows of the accepted
tokens must be written again from the target's hiddens (the catch-up) before the next propose
reads them. Run apart, that is a third graph run a decode step, a whole pass of the MTP block
over a few rows. ``propose_device(..., catchup=)`` writes them in the chain's first step
instead, as engines run their drafter's first forward over the accepted tokens (an EAGLE
"extend"): the K = 1 chain runs over the n propose rows and the catch-up rows together (a run
is causal over rows of one sequence), and the K - 1 chain continues from its first n rows on
the device. The step reads the weights once for both, and a decode step runs the proposer's two
graphs and the verify. Catch-up rows beyond the largest bucket are written first in prefill runs.

Example
-------
>>> handle = prop.propose_device([5, 17], hiddens, [40, 9], 3, [s0, s1])   # doctest: +SKIP
>>> verify_input[:2].copy_(handle.drafts)                                  # doctest: +SKIP
>>> prop.after_verify_device(handle, [3, 1], dropped=False)                # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from draftgraph.graphs.draft_chain import is_gated
from draftgraph.ops.nonfinite import DROPPED, NONFINITE
from draftgraph.runtime.cache.hidden_rows import as_tensor
from draftgraph.runtime.errors import InputError, NonFiniteError, describe
from draftgraph.runtime.native import batch_kernel
from draftgraph.runtime.proposer.catchup import (
    CatchupRows,
    PlacedCatchup,
    check_rows,
    joined,
    place_rows,
    rows_of,
    usual_rows,
    write_in_prefill_runs,
)
from draftgraph.runtime.proposer.checks import (
    any_set,
    check_count,
    check_hiddens,
    check_ints,
    check_states,
    known_buckets,
    same_ints,
    states_length,
)


@dataclass(eq=False)
class DeviceDrafts:
    """A device propose awaiting its verify: the drafts on the device and what the commit needs.

    drafts : int64 [n, K] on the proposer's device, a view of the chain's output buffer
        (``NONFINITE`` in every entry when the chain dropped the batch for a non-finite hidden).
    """

    drafts: torch.Tensor  # [n, K]
    num_drafts: int
    states: list
    keys: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    kv_start: np.ndarray  # int64 [n]: each row's kv_start after the propose
    seq_len: np.ndarray  # int64 [n]: each row's seq_len at the propose (a propose since changes it)
    mapped: np.ndarray | None  # (row, entry) pairs of the blocks the propose mapped
    proposer_id: int
    catchup: PlacedCatchup | None = None  # the catch-up rows it wrote first (undone if the chain drops)
    is_finished: bool = field(default=False)

    @property
    def num_sequences(self) -> int:
        return len(self.keys)


def _pending(prop) -> dict[int, DeviceDrafts]:
    """The proposer's placed keys -> their unfinished device propose (made on first use)."""
    pending = getattr(prop, "_device_pending", None)
    if pending is None:
        pending = prop._device_pending = {}
    return pending


def propose_device(prop, last_tokens, target_hiddens, positions, num_drafts, states, catchup=None,
                   assume_finite: bool = False) -> DeviceDrafts:
    """``propose_batch`` without the read-back: the chain runs, the drafts stay on the device.

    Takes what ``propose_batch`` takes (B tokens, B hiddens or one [B, C, D] / [B, D] tensor,
    B positions, K, B states). Checked as propose_batch checks them, all before any work;
    also refused: a gated chain (draft_conf_tau > 0 and K > 1) and a state whose last device
    propose is not finished. See the module docstring.

    ``catchup=(tokens, hiddens, first_pos)``, one entry each per state as ``catchup_batch``
    takes them: rows each sequence owes right before its propose's position (an empty entry for
    none), written in the chain's first step (design note "catch-up in the first step").
    Their finiteness is checked on the device with the propose's own hiddens; rows past the
    largest bucket are written in prefill runs first and checked on the host (one sync), unless
    ``assume_finite`` (the caller checked them on the device).
    """
    n = states_length(states)
    if not 1 <= n <= prop.propose_batch_max():
        raise InputError(describe("batch size", f"1..{prop.propose_batch_max()} (propose_batch_max)", n))
    with prop._lock:
        k = check_count(num_drafts, "num_drafts", 1, prop.options.max_num_drafts)
        if is_gated(prop.options.draft_conf_tau, k):
            raise InputError(describe("propose_device chain", "an ungated chain (draft_conf_tau 0 or K = 1)",
                                      f"draft_conf_tau {prop.options.draft_conf_tau}, K = {k}",
                                      "a gated chain's kept drafts are a host decision: use propose_batch"))
        keys, tokens, pos = prop._batch_arrays(states, last_tokens, positions, n)
        if keys is prop._one[0]:  # propose's one-row arrays, rewritten by the next call: the handle keeps its own
            keys, tokens, pos = keys.copy(), tokens.copy(), pos.copy()
        try:
            hiddens = check_hiddens(target_hiddens, prop._hidden_shape, prop.device, n)
        except InputError:
            prop._check_items(states, tokens, pos, k, n)
            raise
        pending = _pending(prop)
        if pending:  # a decode loop's propose finds none: its after_verify_device took them
            for key in [key for key in pending if prop.rows.key[key & batch_kernel.ROW_MASK] != key]:
                del pending[key]  # states freed before their after_verify_device (an aborted decode)
        waiting = [i for i, key in enumerate(keys.tolist()) if key in pending] if pending else None
        if waiting:
            check_states(states, prop.id, prop.rows, n)  # a freed state is named as such
            raise InputError(describe(f"states[{waiting[0]}]", "a state with no unfinished device propose",
                                      "one whose propose_device awaits after_verify_device",
                                      "call after_verify_device(handle, ...) first"))
        owed = _checked_catchup(prop, catchup, states, keys, pos) if catchup is not None else None
        if owed is not None:
            return _propose_merged(prop, keys, tokens, pos, hiddens, k, states, owed, assume_finite)
        _, staging, executor, _, copy_in, _ = prop._plan(n, k, False)
        kv = np.zeros(n, dtype=np.int64)
        mapped = prop._place(keys, tokens, pos, k, states, kv)
        try:
            staging.stage(prop.rows.tables, keys, pos, kv, tokens, hiddens, prop._vocab_limit(), None,
                          copy_in=copy_in)
            if prop.options.poison_arena:
                executor.poison()
            outputs = executor.run(staging.chain_inputs(None), check=False)
        except BaseException:
            if mapped is not None:
                prop._unmap(mapped)
            raise
        return _pending_handle(prop, outputs["drafts"][:n], outputs, k, states, keys, pos, kv, mapped)


def after_verify_device(prop, handle: DeviceDrafts, num_accepted, dropped: bool | None = None) -> None:
    """Commit a device propose's rows and roll them back to the accepted drafts, in one call.

    ``num_accepted`` : one int per sequence of the handle, 0..K. ``dropped`` : whether the chain
    dropped the batch (its drafts are ``NONFINITE``), as the caller's read-back says; None reads
    it here (one host sync). A dropped batch raises NonFiniteError and its states are as before
    the propose (the blocks it mapped go back). All or nothing: a bad count or a stale handle
    raises InputError and changes nothing.
    """
    if not isinstance(handle, DeviceDrafts) or handle.proposer_id != prop.id:
        raise InputError(describe("handle", "a DeviceDrafts of this proposer's propose_device",
                                  type(handle).__name__))
    with prop._lock:
        if handle.is_finished:
            raise InputError(describe("handle", "an unfinished device propose", "one already finished",
                                      "after_verify_device once per propose_device"))
        n, k, rows, seqs = handle.num_sequences, handle.num_drafts, handle.keys & batch_kernel.ROW_MASK, prop.rows
        # The states were checked by the propose and are the handle's own objects: only their
        # liveness can have changed (a free since), one compare for the batch; the item checks
        # name the first freed state.
        if not same_ints(seqs.key[rows], handle.keys):
            check_states(handle.states, prop.id, seqs, n)
        if any_set(seqs.verify_due[rows]) or not same_ints(seqs.seq_len[rows], handle.seq_len):
            raise InputError(describe("handle", "the states as propose_device left them",
                                      "a state proposed or changed since", "one propose per verify"))
        accepted = np.ascontiguousarray(check_ints(num_accepted, "num_accepted", 0, k + 1, n))
        if dropped is None:
            dropped = int(handle.drafts[0, 0]) == NONFINITE
        pending = _pending(prop)
        for key in handle.keys.tolist():
            pending.pop(key, None)
        handle.is_finished = True
        if dropped:  # the chain wrote no cache row: the states go back to before the propose
            if handle.mapped is not None:
                prop._unmap(handle.mapped)
            if handle.catchup is not None:
                handle.catchup.undo(prop)
            raise NonFiniteError(describe("target_hiddens", "finite values", "a NaN or an infinity",
                                          "the propose is refused: no state or cache row changed"))
        bound, kept = prop._bound(), np.zeros(n, dtype=np.int64)
        with prop.cache.lock:
            prop._kernel.commit(bound, handle.keys, handle.positions, handle.kv_start, np.zeros((n, k), dtype=np.int64),
                                k, False, kept)
            status, index, _ = prop._kernel.verify(bound, handle.keys, accepted)
        if status != batch_kernel.OK:  # every check above holds, so this cannot be refused
            raise AssertionError(f"the batch kernel's verify refused (status {status}, row {index}) a checked batch")


def warm_up(prop, num_drafts: int, chain_buckets: Sequence[int], prefill_buckets: Sequence[int],
            first_step_buckets: Sequence[int] = ()) -> None:
    """Build (and on CUDA capture) the K-draft chains and the drafter-prefill graphs of these buckets.

    ``first_step_buckets``: the row buckets of merged first steps (``propose_device`` with a
    catch-up); with them, the K - 1 chains that continue them at the chain buckets too.
    Eager executors run once on dead rows, so that on CUDA every Triton kernel they launch is
    compiled here and not in the first propose or catch-up; captured ones are captured (a
    capture runs them twice first). Every staging buffer is marked dead first: a run writes no
    cache row. Buckets not in the proposer's set are refused before any work.
    """
    k = check_count(num_drafts, "num_drafts", 1, prop.options.max_num_drafts)
    chain = known_buckets("chain buckets", chain_buckets, prop.buckets, "proposer")
    prefill = known_buckets("prefill buckets", prefill_buckets, prop.buckets, "proposer")
    first = known_buckets("first-step buckets", first_step_buckets, prop.buckets, "proposer")
    with prop._lock:
        for bucket in chain:
            _run_dead(prop, bucket, prop._executor(bucket, k, False))
        for bucket in prefill:
            _run_dead(prop, bucket, prop._prefill_executor(bucket))
        for bucket in first:
            _run_dead(prop, bucket, prop._executor(bucket, 1, False))
        if first and k > 1:
            for bucket in chain:
                staging, executor = _continuation(prop, bucket, k - 1)
                _run_dead(prop, bucket, executor, staging)


def _run_dead(prop, bucket: int, executor, staging=None) -> None:
    staging = staging or prop._staging_for(bucket)
    empty = np.zeros(0, dtype=np.int64)
    staging.stage(prop.rows.tables, empty, empty, empty, empty, [], prop._vocab_limit())  # every row dead
    executor.warm(staging.chain_inputs(None))


# ---- the catch-up in the chain's first step ------------------------------------------------------
def _checked_catchup(prop, owed, states, keys: np.ndarray, pos: np.ndarray) -> CatchupRows | None:
    """A propose's catch-up argument, checked (the host's finiteness check is the caller's)."""
    if not isinstance(owed, (tuple, list)) or len(owed) != 3:
        raise InputError(describe("catchup", "(tokens, hiddens, first_pos), one entry each per state",
                                  type(owed).__name__))
    rows = usual_rows(prop, *owed, keys)  # design note "checks the kernel makes" (catchup.py)
    if rows is None:
        rows = check_rows(prop, *owed, states, assume_finite=True, keys=keys)
    else:
        rows.recheck = lambda: check_rows(prop, *owed, states, assume_finite=True)
    if rows is None:
        return None
    ends = rows.starts + rows.count
    if not same_ints(ends, pos[rows.index]):
        wrong = ends != pos[rows.index]
        if rows.recheck is not None:
            rows.recheck()  # a bad state or position is named first, as check_rows names it
        off = np.flatnonzero(wrong)
        j, i = int(off[0]), int(rows.index[off[0]])
        raise InputError(describe(f"catchup rows of states[{i}]", f"positions up to {int(pos[i]) - 1}",
                                  f"positions {int(rows.starts[j])} .. {int(ends[j]) - 1}",
                                  "a propose's catch-up rows are those right before its own position"))
    return rows


def _continuation(prop, n: int, num_drafts: int):
    """The staging and executor of a K-draft chain that continues a merged first step: no in-graph
    copy (its first token comes from that step, on the device), its own staging buffers."""
    bucket = prop._bucket(n)
    staging = prop._continuation_staging.get(bucket)
    if staging is None:
        staging = prop._continuation_staging[bucket] = prop._new_staging(bucket)
    key = ("continue", bucket, num_drafts, prop.use_captured)
    if key not in prop._executors:
        prop._executors[key] = prop._make_executor(prop.chain_graph(num_drafts), bucket, None, staging)
    return staging, prop._checked(prop._executors[key])


def _propose_merged(prop, keys, tokens, pos, hiddens, k: int, states, owed: CatchupRows,
                    assume_finite: bool) -> DeviceDrafts:
    """Design note "catch-up in the first step"; the caller holds the lock and has checked everything.

    Step 1 of the chain runs as the K = 1 chain over the n propose rows (rows 0..n-1, so their
    outputs need no gather) and the catch-up rows (a graph run is causal over rows of one
    sequence: ops/attention.py writes every row's latent before any row reads); steps 2..K are
    the K - 1 chain continuing from step 1's drafts and hiddens, on the device. Catch-up rows
    past the largest bucket go first, in prefill runs.
    """
    n = len(keys)
    early = max(owed.num_rows - (prop.buckets[-1] - n), 0)
    first = rows_of(owed.hidden, slice(0, early)) if early else None  # the rows the prefill runs write
    if early and not assume_finite and not bool(torch.isfinite(as_tensor(first)).all()):
        raise NonFiniteError(describe("catch-up hiddens", "finite values", "a NaN or an infinity",
                                      "the call is refused: no state or cache row changed"))
    placed = place_rows(prop, owed)  # the states now end right before their propose's row
    kv = np.zeros(n, dtype=np.int64)
    try:
        mapped = prop._place(keys, tokens, pos, k, states, kv)
    except BaseException:  # refused (nothing mapped for the propose's rows): the catch-up's go back too
        placed.undo(prop)
        raise
    which, at, owed_kv = owed.which(), owed.positions(), placed.row_kv
    try:
        if early:
            write_in_prefill_runs(prop, which[:early], at[:early], owed_kv[:early], owed.tokens[:early], first)
        _, staging, executor, _, copy_in, _ = prop._plan(n + owed.num_rows - early, 1, False)
        # Held until the launch: a captured chain gathers the rows from its buffer's addresses when it runs.
        step_hidden = joined(hiddens, rows_of(owed.hidden, slice(early, None)) if early else owed.hidden,
                             prop._hidden_shape)
        staging.stage(prop.rows.tables, np.concatenate((keys, which[early:])), np.concatenate((pos, at[early:])),
                      np.concatenate((kv, owed_kv[early:])), np.concatenate((tokens, owed.tokens[early:])),
                      step_hidden, prop._vocab_limit(), None, copy_in=copy_in)
        if prop.options.poison_arena:
            executor.poison()
        outputs = executor.run(staging.chain_inputs(None), check=False)
        drafts = outputs["drafts"][:n]
        if k > 1:
            rest, continuation = _continuation(prop, n, k - 1)
            rest.stage(prop.rows.tables, keys, pos + 1, kv, tokens, outputs[list(outputs)[2]][:n],
                       prop._vocab_limit(), None, copy_in=True)
            # The first draft is the continuation's token (a dropped step's NONFINITE mark is no token
            # id); a dropped step drops the continuation too, so the call writes no drafter row.
            torch.clamp(drafts[:, 0], min=0, out=rest.views["token"][:n])
            rest.views["meta"].pos[:n].masked_fill_(drafts[:, 0] == NONFINITE, DROPPED)
            if prop.options.poison_arena:
                continuation.poison()
            outputs = continuation.run(rest.chain_inputs(None), check=False)
            drafts = torch.cat([drafts, outputs["drafts"][:n]], dim=1)
    except BaseException:
        if mapped is not None:
            prop._unmap(mapped)
        placed.undo(prop)
        raise
    return _pending_handle(prop, drafts, outputs, k, states, keys, pos, kv, mapped, placed)


def _pending_handle(prop, drafts, outputs, k: int, states, keys, pos, kv, mapped,
                    placed: PlacedCatchup | None = None) -> DeviceDrafts:
    """The handle of a device propose that ran, each of its states marked as awaiting it."""
    rows = keys & batch_kernel.ROW_MASK
    handle = DeviceDrafts(drafts, k, list(states), keys, pos, kv, prop.rows.seq_len[rows].copy(), mapped, prop.id,
                          placed)
    pending = _pending(prop)
    for key in keys.tolist():
        pending[key] = handle
    prop.last_outputs, prop.last_rows = outputs, len(states)
    return handle
