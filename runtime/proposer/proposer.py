"""DeepseekV4MtpProposer: the seed's DraftProposer over the graph executor.

A propose is ONE run of the K-draft chain graph: the K drafts chain on the device (each argmax
feeds the next embed, positions advance inside the graph) and the host reads the K tokens back
once, at the end. Executors are made per (batch bucket, K, masked) and kept; the captured
executor (CUDA) and the eager one run the same graph behind the same API.

Design note "one path": what the host knows of its sequences is a persistent batch of flat
arrays (proposer/sequences.py). A propose checks its batch and maps blocks for the rows that
cross into a block they do not hold (the batch kernel's ``place``), writes the staging buffer
(``write``, cache/staging.py), launches, reads the drafts back, and writes the batch's rows back
(``commit``); an after_verify is the kernel's ``verify``. The kernel is one C call per step over
the flat arrays (runtime/native/batch_kernel.py, its numpy twin where no compiler is), so the
Python per row left is turning the caller's lists into arrays (one [B, C, D] hiddens tensor is
checked once; a list of B is checked tensor by tensor). Every call runs this one path, whatever
the batch; a refused call is named item by item, on the error path only.

Design note "threads": every call that reads or writes sequences, the cache, the staging
buffers or the executors holds the proposer's one lock, from its checks to its read-back. A
proposer may so be shared by threads that use separate states: each call is atomic, and the
drafts are those of the same calls made one after another. The lock costs ~0.2 us uncontended
(~1 us more where the caller runs with autograd on: it is held with grad off, call_lock.py);
contended, calls wait for each other (the device runs one chain at a time anyway).

Drafter rows are position-indexed (see state.py). Pair semantics, as in the seed: the row at
position p is computed from the pair (token t_{p+1}, hidden of position p); ``propose(t, h, p,
K)`` writes rows p .. p+K-1 (row p from the target's hidden, later rows from the MTP's own).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from draftgraph.graphs.draft_chain import (
    ChainSpec,
    build_draft_chain,
    build_drafter_prefill,
    hidden_spec,
    is_gated,
    mask_words,
)
from draftgraph.graphs.v4_block import CacheGeometry, Numerics, block_interface, numerics_for
from draftgraph.ops.nonfinite import NONFINITE
from draftgraph.runtime.cache.hidden_rows import as_tensor
from draftgraph.runtime.cache.paged_cache import BLOCK_SIZE, PagedLatentCache, TakenBlocks
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.device import concrete_device
from draftgraph.runtime.errors import CacheError, CaptureError, InputError, NonFiniteError, describe
from draftgraph.runtime.execution.eager import EagerExecutor, bind_tensors, check_tensor_map
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.native import batch_kernel
from draftgraph.runtime.proposer import device_propose
from draftgraph.runtime.proposer.binding import TENSORS_HINT, DraftBinding, prepare_weights, weight_formats
from draftgraph.runtime.proposer.call_lock import CallLock
from draftgraph.runtime.proposer.catchup import check_rows, place_rows, write_in_prefill_runs
from draftgraph.runtime.proposer.checks import (
    as_int,
    check_bitmask,
    check_count,
    check_hiddens,
    check_ints,
    check_state,
    check_states,
    is_on,
    sequence_length,
    states_length,
)
from draftgraph.runtime.proposer.options import DEFAULT_BUCKETS, ProposerOptions, check_buckets
from draftgraph.runtime.proposer.runners.base import RunnerNode, load_runner, runner_name
from draftgraph.runtime.proposer.sequences import SequenceRows
from draftgraph.runtime.proposer.sharding import runners_for, shard_setup
from draftgraph.runtime.proposer.state import MtpProposerState

__all__ = ["DEFAULT_BUCKETS", "CarriedKv", "DeepseekV4MtpProposer", "LaunchPlan", "ProposerOptions"]
_ids = iter(range(1, 1 << 62))


class LaunchPlan(NamedTuple):
    """What a propose of one batch size, K and maskedness looks up, once per generation."""

    bucket: int
    staging: ChainStaging
    executor: object
    generation: int  # the proposer's generation it was made in: stale once executors are dropped
    copy_in: bool  # the staging copies the host buffer up itself (no graph that copies it at its head)
    gated: bool  # confidence gates: the chain may stop before K drafts


class CarriedKv(tuple):
    """(blocks, rows, last_pair_key) as the seed's take_drafter_kv returns, plus ``kv_start``."""

    def __new__(cls, blocks, rows, last_pair_key, kv_start=0, taken=None):
        obj = super().__new__(cls, (blocks, rows, last_pair_key))
        obj.kv_start, obj.taken = kv_start, taken
        return obj


_PLAIN_INTS = frozenset({int, np.int64, np.int32})
_KEY = operator.attrgetter("key")


def _plain_ints(values, n: int) -> bool:
    """Whether ``values`` is n plain ints (a list or tuple) or an int64/int32 array: no item checks due."""
    if type(values) in (list, tuple):
        return len(values) == n and set(map(type, values)) <= _PLAIN_INTS
    return isinstance(values, np.ndarray) and values.dtype.kind in "iu" and values.shape == (n,)


def _int64_array(values, n: int) -> np.ndarray | None:
    """``values`` as int64 [n] when they are n plain ints that fit; else None (the item checks say why)."""
    if not _plain_ints(values, n):
        return None
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return None


def _nonfinite_rows(hiddens) -> list[int]:
    """The rows holding a NaN or an infinity (the error's message: a host sync, on that path only)."""
    hiddens = hiddens if isinstance(hiddens, list) else as_tensor(hiddens)
    rows = hiddens if isinstance(hiddens, torch.Tensor) else torch.stack([h.reshape(-1) for h in hiddens])
    return torch.nonzero(~torch.isfinite(rows.reshape(rows.shape[0], -1)).all(dim=1)).flatten().tolist()


def _serialized(method):
    """Run ``method`` under the proposer's lock (design note "threads")."""

    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    locked.__name__, locked.__doc__, locked.__wrapped__ = method.__name__, method.__doc__, method
    return locked


def _window_blocks(config: V4Config, options: ProposerOptions) -> int:
    """Blocks that a window and a propose's K positions fill (the sizing of the cache pool per sequence)."""
    return math.ceil((config.sliding_window + options.max_num_drafts) / BLOCK_SIZE)


class DeepseekV4MtpProposer:
    """The DeepSeek-V4 MTP draft proposer.

    Example
    -------
    >>> prop = DeepseekV4MtpProposer.from_checkpoint("ckpt/")            # doctest: +SKIP
    >>> state = prop.alloc_state()                                        # doctest: +SKIP
    >>> drafts = prop.propose(token, hidden, position, 3, state)          # doctest: +SKIP
    >>> prop.after_verify(num_accepted=2, state=state)                    # doctest: +SKIP
    >>> prop.free_state(state)                                            # doctest: +SKIP
    """

    def __init__(self, config: V4Config, tensors, *, device=None, options: ProposerOptions | None = None, **kw):
        if not isinstance(config, V4Config):
            raise InputError(describe("config", "a V4Config", type(config).__name__,
                                      "DeepseekV4MtpProposer.from_checkpoint(path) reads a checkpoint folder"))
        check_tensor_map("tensors", tensors, "checkpoint names", TENSORS_HINT)  # before anything is allocated
        if options is not None and kw:
            raise InputError(describe("options", "options= or keyword options, not both", f"options= and {sorted(kw)}",
                                      "dataclasses.replace(options, ...) sets fields of an options object"))
        if options is not None and not isinstance(options, ProposerOptions):
            raise InputError(describe("options", "a ProposerOptions", type(options).__name__))
        self.options = opts = options or ProposerOptions(**kw)
        opts.check(config.vocab_size, BLOCK_SIZE, config.max_position_embeddings)
        self.config = config
        self.device = concrete_device(device) if device is not None else torch.device("cpu")
        self.id = next(_ids)
        self.max_seq_len = opts.max_seq_len or config.max_position_embeddings
        self.buckets = check_buckets(opts.buckets)
        blocks = opts.num_cache_blocks or self.buckets[-1] * (_window_blocks(config, opts) + 2)
        self.cache = PagedLatentCache(config, blocks, max_seq_len=self.max_seq_len, device=self.device)
        self.geometry = CacheGeometry(self.cache.kv.shape[0], self.cache.max_blocks_per_seq, self.cache.block_size)
        self.rows = SequenceRows(self.cache.max_blocks_per_seq, self.cache.block_size)
        opts.check_on(self.device)
        # Several ranks: this rank's ShardPlan and the RankGroup its executors get (proposer/sharding.py).
        self.shard, self.rank_group = shard_setup(config, opts.process_group, opts.mtp_vocab_size, self.device)
        self.weights = prepare_weights(config, tensors, self.device, weights=opts.weights_on(self.device),
                                       shard=self.shard, head_dtype=opts.head_dtype)
        self.state_tensors = {"mtp.0.kv_cache": self.cache.kv}
        self.runner = None
        self._lock = CallLock()  # autograd off while held (call_lock.py)
        self._executors: dict[tuple, object] = {}
        self._staging: dict[int, ChainStaging] = {}
        self._continuation_staging: dict[int, ChainStaging] = {}  # a chain after a merged first step's
        self._plans: dict[tuple[int, int, bool], LaunchPlan] = {}  # (n, K, masked) -> what a propose looks up
        self._kernel = batch_kernel.load()  # design note "flat kernel": the compiled twin where it builds
        self._size_batch_buffers()
        self._kernel_state = None  # _bound: (the rows' key array it was bound with, the bound state)
        self._hidden_shape = tuple(hidden_spec(config, opts.mode).shape[1:])
        self._mask_words = mask_words(config, opts.mtp_vocab_size)
        self._last_confidence: float | None = None
        self._deferred_token: torch.Tensor | None = None
        self.last_propose_seconds = 0.0  # entering propose to its return
        self.last_host_seconds = 0.0  # entering propose to the (asynchronous) launch
        self.last_times: tuple[float, ...] = ()  # perf_counter at entry, launch, read-back done, return
        self.last_outputs: dict[str, torch.Tensor] = {}
        self.last_rows = 0  # the sequences of the last propose (its outputs hold the bucket's rows)
        self.tracer = None  # draftgraph.tools.trace.Tracer, set by attach(); handed to every executor
        self.generation = 0  # bumped whenever executors are dropped; a stale executor never runs
        self._pool = None  # one CUDA graph memory pool shared by every capture
        self.use_captured = opts.executor == "captured" or (opts.executor == "auto" and self.device.type == "cuda")
        self._check_weights(self.weights)  # a missing or misshapen weight: refused here, not at the first propose

    @staticmethod
    def from_checkpoint(path: str | Path, device=None, **kw) -> DeepseekV4MtpProposer:
        """A proposer on the checkpoint at ``path``; with ``process_group=`` only this rank's shard is read."""
        from draftgraph.runtime.model.checkpoint_path import as_path, path_kind
        from draftgraph.runtime.model.config import V4Config
        from draftgraph.runtime.model.weights import CHECKPOINT_PATH, load_checkpoint

        config, shard = None, None
        if device is not None:
            device = concrete_device(device)  # a device it cannot run on: refused before the read
        # The group comes as a keyword or inside options= (the constructor takes either, not both);
        # made here from every keyword, so that an unknown one fails before the read too.
        opts = kw.get("options")
        given = opts if isinstance(opts, ProposerOptions) else ProposerOptions(
            **{key: value for key, value in kw.items() if key != "options"})
        if given.process_group is not None:
            where = as_path(path, "checkpoint path", CHECKPOINT_PATH)
            folder = path_kind(where, "checkpoint path", CHECKPOINT_PATH) == "dir"
            config = V4Config.load(where if folder else where.parent)
            given.check(config.vocab_size, BLOCK_SIZE, config.max_position_embeddings)  # before the plan
            shard, _ = shard_setup(config, given.process_group, given.mtp_vocab_size, device)
            if shard is None:  # a world of one: the unsharded proposer, no group to set up again
                if opts is given:
                    kw["options"] = dataclasses.replace(opts, process_group=None)
                else:
                    kw["process_group"] = None
        # As stored (FP8 / MXFP4 kept): prepare_weights keeps or dequantises them by options.weights.
        ckpt = load_checkpoint(path, config, device="cpu", weights="native", shard=shard)
        return DeepseekV4MtpProposer(ckpt.config, ckpt.tensors, device=device, **kw)

    # ---- state -------------------------------------------------------------------------------
    def alloc_state(self) -> MtpProposerState:
        return self.alloc_state_for(None)

    @_serialized
    def alloc_state_for(self, budget_tokens: int | None) -> MtpProposerState:
        """A fresh state; ``budget_tokens`` (prompt + max tokens) bounds its positions (None = max)."""
        limit = self.max_seq_len
        if budget_tokens is not None:
            limit = min(check_count(budget_tokens, "budget_tokens", 1, 1 << 62), self.max_seq_len)
        return MtpProposerState(self.rows, self.rows.alloc(limit), self.id)

    @_serialized
    def free_state(self, state: MtpProposerState) -> None:
        """Return every block the state holds; the state cannot be used again."""
        check_state(state, self.id, self.rows)
        self.cache.free(self.rows.table_of[state.row])
        self.rows.release(state.row)

    # ---- propose -----------------------------------------------------------------------------
    def propose(self, last_token, target_hidden, position, num_drafts, state, grammar_bitmask=None,
                draft_embed_target: torch.Tensor | None = None) -> list[int]:
        """Draft ``num_drafts`` tokens after ``last_token`` (t_{p+1}) given the target's hidden at ``position`` (p).

        The hidden is [C, D] (streams mode: the target's pre-hc_head streams) or [D]
        (collapsed). One run of the K-draft chain; the K tokens are read back once. A grammar
        bitmask (int32 words, bit t of word t // 32) is applied on the device to every draft;
        one that allows nothing gives draft 0 and a warning. With ``draft_embed_target`` the last
        draft's embedding row is left there (on the device) and ``read_deferred_draft_token()``
        returns its id. A hidden holding a NaN or an infinity raises NonFiniteError.
        """
        with self._lock:
            if draft_embed_target is not None:
                self._check_embed_target(draft_embed_target)
            drafted = self._propose([last_token], [target_hidden], [position], num_drafts, [state],
                                    grammar_bitmask)
            if draft_embed_target is not None:  # the last draft kept (fewer than K when confidence gated)
                self._leave_embedding(self.last_outputs["drafts"][:1, len(drafted[0]) - 1], draft_embed_target)
            return drafted[0]

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states, out_conf=None):
        """B sequences in one chain run (weights read once per draft position); equals B ``propose`` calls.

        ``target_hiddens`` is either a sequence of B hiddens, each as ``propose`` takes it, or
        one bf16 tensor [B, C, D] (streams) or [B, D] (collapsed) on the proposer's device, as
        vLLM and SGLang hold them: checked once and staged as one block, with no work per row.
        ``last_tokens`` and ``positions`` are sequences of ints (numpy integers too) or integer
        numpy arrays. ``out_conf``, a list, receives each sequence's per-draft top-1 probabilities.

        Example
        -------
        >>> prop.propose_batch([5, 17], torch.stack([h0, h1]), [40, 9], 3, [s0, s1])  # doctest: +SKIP
        """
        n = states_length(states)
        if not 1 <= n <= self.propose_batch_max():
            raise InputError(describe("batch size", f"1..{self.propose_batch_max()} (propose_batch_max)", n))
        if out_conf is not None and not isinstance(out_conf, list):  # before the run: a failing call changes nothing
            raise InputError(describe("out_conf", "a list (it receives each row's probabilities) or None",
                                      type(out_conf).__name__))
        with self._lock:
            drafts = self._propose(last_tokens, target_hiddens, positions, num_drafts, states, None)
            if out_conf is not None:
                probs = self._read_probs(len(drafts))
                out_conf.clear()
                out_conf.extend(probs[i, : len(row)].tolist() for i, row in enumerate(drafts))
            return drafts

    def propose_batch_max(self) -> int:
        return self.buckets[-1]

    def propose_device(self, last_tokens, target_hiddens, positions, num_drafts, states, catchup=None,
                       assume_finite: bool = False):
        """``propose_batch`` whose drafts stay on the device (no read-back); see proposer/device_propose.py.

        Returns a DeviceDrafts: ``.drafts`` int64 [B, K] on the device. Finish it with
        ``after_verify_device(handle, num_accepted, dropped)`` once the verify has been read back.
        ``catchup=(tokens, hiddens, first_pos)``: the rows each sequence owes before its propose
        (``catchup_batch``'s arguments less the states), written in the chain's first step.
        """
        return device_propose.propose_device(self, last_tokens, target_hiddens, positions, num_drafts, states, catchup,
                              assume_finite)

    def after_verify_device(self, handle, num_accepted, dropped: bool | None = None) -> None:
        """Commit a ``propose_device`` and roll it back to ``num_accepted`` (proposer/device_propose.py)."""
        device_propose.after_verify_device(self, handle, num_accepted, dropped)

    def warm_up(self, num_drafts: int, chain_buckets, prefill_buckets, first_step_buckets=()) -> None:
        """Build, and on CUDA capture, the chains and drafter-prefill graphs of these buckets (device_propose.py)."""
        device_propose.warm_up(self, num_drafts, chain_buckets, prefill_buckets, first_step_buckets)

    def _size_batch_buffers(self) -> None:
        """The kernel's per-row outputs, one row per sequence of the largest bucket."""
        size = self.buckets[-1]
        self._kv, self._kept = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
        self._one = tuple(np.zeros(1, dtype=np.int64) for _ in range(3))  # a propose's key, token, position
        self._verify_one = (np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))  # after_verify's
        # (row, entry) pairs of the blocks a propose mapped; K <= the block size: two entries a row
        self._mapped = np.zeros(4 * size, dtype=np.int64)
        self._span = np.zeros(1, dtype=np.int64)  # the kernel's spans: K for every row of a propose

    def _propose(self, tokens, hiddens, positions, num_drafts, states, bitmask) -> list[list[int]]:
        """The one path of every propose (design note "one path"); the caller holds the lock."""
        entered = time.perf_counter()
        seqs, n, kernel = self.rows, len(states), self._kernel
        k = check_count(num_drafts, "num_drafts", 1, self.options.max_num_drafts)
        keys, tokens, pos = self._batch_arrays(states, tokens, positions, n)
        try:
            hiddens = check_hiddens(hiddens, self._hidden_shape, self.device, n)
            mask = self._checked_mask(bitmask)
        except InputError:  # the error is the first kind's, as item by item: states, tokens, positions first
            self._check_items(states, tokens, pos, k, n)
            raise
        _, staging, executor, _, copy_in, gated = self._plan(n, k, mask is not None)
        kv, cache = self._kv[:n], self.cache
        mapped = self._place(keys, tokens, pos, k, states, kv)
        bound = self._bound()
        try:
            staging.stage(seqs.tables, keys, pos, kv, tokens, hiddens, self._vocab_limit(),
                          [mask] * n if mask is not None else None, copy_in=copy_in)
            if self.options.poison_arena:
                executor.poison()
            outputs = executor.run(staging.chain_inputs(self._mask_words if mask is not None else None), check=False)
            launched = time.perf_counter()
            drafts = staging.read_rows(outputs["drafts"], n)  # [n, K]: the one device-to-host read
            read = time.perf_counter()
            self.last_outputs, self.last_rows = outputs, n
            if drafts[0, 0] == NONFINITE:  # the chain dropped every row: it wrote no cache row
                raise NonFiniteError(describe("target_hiddens" if n > 1 else "target_hidden", "finite values",
                                              f"a NaN or an infinity in row(s) {_nonfinite_rows(hiddens)}",
                                              "the call is refused: no state or cache row changed"))
        except BaseException:
            if mapped is not None:
                self._unmap(mapped)
            raise
        kept = self._kept[:n]
        with cache.lock:
            kernel.commit(bound, keys, pos, kv, drafts, k, gated, kept)
        drafted = drafts.tolist()
        if gated and kept.min() < k:  # the blocks mapped for drafts the chain did not make go back
            drafted = [d[:c] for d, c in zip(drafted, kept.tolist())]
            for key, length in zip(keys[kept < k].tolist(), (pos + kept)[kept < k].tolist()):
                self.cache.truncate(seqs.table_of[key & batch_kernel.ROW_MASK], length)
        if self.options.draft_conf_tau > 0:
            probs = self._read_probs(n)
            self._last_confidence = min(float(probs[i, :m].min()) for i, m in enumerate(kept.tolist()))
        else:
            self._last_confidence = None
        done = time.perf_counter()
        self.last_host_seconds, self.last_propose_seconds = launched - entered, done - entered
        self.last_times = (entered, launched, read, done)
        return drafted

    def _place(self, keys: np.ndarray, tokens: np.ndarray, pos: np.ndarray, k: int, states,
               kv_out: np.ndarray) -> np.ndarray | None:
        """The checks, each row's kv_start after the propose into ``kv_out`` (kept by a propose
        continuing its rows, kv_start <= p <= seq_len; p for one jumping ahead or back), and blocks
        for the rows crossing into a block they do not hold, all or nothing, in one kernel call
        (design note "flat kernel"). Returns the (row, entry) pairs it mapped (None: none), the
        undo for ``_unmap``; raises the typed error of what it refused, with nothing mapped."""
        cache, n, span = self.cache, len(keys), self._span
        span[0] = k  # every row's
        with cache.lock:
            status, index, m = self._kernel.place(self._bound(), keys, tokens, pos, span, kv_out, self._mapped)
        if status != batch_kernel.OK:
            self._refuse(status, index, states, tokens, pos, k, n)
        if not m:
            return None
        mapped = self._mapped[: 2 * m].reshape(m, 2).copy()
        for row in set(mapped[:, 0].tolist()):
            self.rows.table_of[row].cache_id = cache.cache_id
        return mapped

    def _bound(self):
        """The batch kernel's bound state (``batch_kernel.bind``: the rows' and the pool's arrays and
        sizes) for ``place``, ``commit`` and ``verify``; bound again when the rows grow (new arrays)."""
        bound, seqs = self._kernel_state, self.rows
        if bound is None or bound[0] is not seqs.key:
            cache = self.cache
            state = self._kernel.bind(seqs.key, seqs.seq_len, seqs.kv_start, seqs.max_positions, seqs.last_drafted,
                                      seqs.verify_due, seqs.tables, seqs.num_trimmed, cache.block_state,
                                      cache.free_stack, cache.free_top, self.config.vocab_size, self.max_seq_len,
                                      cache.block_size, self.config.sliding_window)
            bound = self._kernel_state = (seqs.key, state)
        return bound[1]

    def _batch_arrays(self, states, tokens, positions, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch as the kernel's arrays: the states' keys, tokens, positions (int64 [n]).

        The usual batch (states, plain ints) takes three conversions; anything else goes through
        the item-by-item checks in their order (states, tokens, positions), which convert what
        they accept (numpy integers, 0-d tensors) and raise for the first bad item.
        """
        if n == 1 and type(tokens) is list and type(positions) is list and len(tokens) == len(positions) == 1:
            # propose's one row: three item writes into arrays kept for it (the caller holds the lock)
            token, position, one = tokens[0], positions[0], self._one
            if type(token) is int and type(position) is int:
                try:
                    one[0][0], one[1][0], one[2][0] = states[0].key, token, position
                    return one
                except (TypeError, AttributeError, OverflowError, IndexError, KeyError):
                    pass  # the checks below name what is wrong
        try:
            keys = np.fromiter(map(_KEY, states), np.int64, n)
        except (TypeError, ValueError, AttributeError):
            keys = None
        tok, pos = _int64_array(tokens, n), _int64_array(positions, n)
        if keys is None or tok is None or pos is None:
            keys = check_states(states, self.id, self.rows, n)
            tok = check_ints(tokens, "last_tokens" if n > 1 else "last_token", 0, self.config.vocab_size, n)
            pos = check_ints(positions, "positions" if n > 1 else "position", 0, self.max_seq_len, n)
        return keys, tok, pos

    def _check_items(self, states, tokens, pos, k: int, n: int) -> None:
        """The item-by-item checks, in their order: each raises the typed error of its first bad item."""
        keys = check_states(states, self.id, self.rows, n)
        check_ints(tokens, "last_tokens" if n > 1 else "last_token", 0, self.config.vocab_size, n)
        check_ints(pos, "positions" if n > 1 else "position", 0, self.max_seq_len, n)
        self._check_budget(keys & batch_kernel.ROW_MASK, pos, k)

    def _refuse(self, status: int, index: int, states, tokens: np.ndarray, pos: np.ndarray, k: int, n: int):
        """Raise the typed error of what the kernel refused (nothing was mapped)."""
        self._check_items(states, tokens, pos, k, n)
        if status == batch_kernel.POOL:
            rows = np.fromiter(map(_KEY, states), np.int64, n) & batch_kernel.ROW_MASK
            tables, bs = self.rows.tables, self.cache.block_size
            needy = int(((tables[rows, pos // bs] < 0) | (tables[rows, (pos + k - 1) // bs] < 0)).sum())
            free = self.cache.num_free_blocks
            raise CacheError(describe(f"MTP cache blocks for {needy} sequences", f"{index} free block(s)",
                                      f"{free} free of {self.cache.num_blocks}",
                                      "free finished sequences, call trim_window, or size the pool larger"))
        raise AssertionError(f"the batch kernel refused (status {status}, row {index}) a batch every check passes")

    def _check_budget(self, rows: np.ndarray, pos: np.ndarray, span: int | np.ndarray, what: str = "position",
                      count: str = "num_drafts") -> None:
        """Every row's positions pos .. pos + span - 1 within its budget (alloc_state_for)."""
        budget = self.rows.max_positions[rows]
        over = pos + span > budget
        if over.any():
            i = int(np.flatnonzero(over)[0])
            n = span if isinstance(span, int) else int(span[i])
            raise InputError(describe(f"{what}s[{i}]" if len(rows) > 1 else what,
                                      f"{what} + {count} <= {int(budget[i])}", f"{int(pos[i])} + {n}",
                                      "the sequence's budget (alloc_state_for) or max_seq_len is reached"))

    def _unmap(self, mapped: np.ndarray) -> None:
        """Give back the blocks a failed propose mapped: (row, entry) pairs."""
        for row in sorted(set(mapped[:, 0].tolist())):
            table = self.rows.table_of[row]
            self.cache.unmap(table, table.blocks[mapped[mapped[:, 0] == row, 1]].tolist())

    def _trim(self, row: int, next_pos: int) -> None:
        """Give back the blocks wholly before the row's window (design note "trimmed front")."""
        self.cache.trim_window(self.rows.table_of[row], next_pos)

    def _read_probs(self, n: int) -> np.ndarray:
        """The last propose's per-draft top-1 probabilities [n, K] (a second read-back)."""
        return self._staging_for(self._bucket(n)).read_rows(self.last_outputs["probs"], n)

    def _checked_mask(self, bitmask) -> torch.Tensor | None:
        """The grammar mask cut to the drafted vocab rows (None when there is none); warns when it allows nothing."""
        if bitmask is None:
            return None
        mask = check_bitmask(bitmask, (self.config.vocab_size + 31) // 32)[: self._mask_words]
        if not bool(mask.ne(0).any()):
            warnings.warn("grammar mask allows no token: the drafts are 0 (pad drafts, rejected at verify)",
                          stacklevel=4)
        return mask

    def last_hidden(self, n: int = 1) -> torch.Tensor:
        """A copy of the last propose's final hidden (streams or h_out) for its first ``n`` rows.

        Confidence-gated (draft_conf_tau > 0), it is the hidden of the last of the K steps, and
        stale when the chain stopped before that step.
        """
        if not self.last_outputs:
            raise InputError(describe("last_hidden", "a propose before it", "none yet",
                                      "propose, propose_batch or propose_device first"))
        n = check_count(n, "last_hidden n", 1, self.last_rows)  # past them: bucket padding, not a sequence's hidden
        (hidden,) = (v for name, v in self.last_outputs.items() if name not in ("drafts", "probs"))
        return hidden[:n].clone()

    def _vocab_limit(self) -> int:
        return self.options.extra.get("vocab_limit", self.config.vocab_size)

    @_serialized
    def set_vocab_limit(self, limit: int | None) -> None:
        """Draft only tokens below ``limit`` (a device value: no re-capture)."""
        if limit is not None:
            limit = check_count(limit, "vocab_limit", 1, self.config.vocab_size)
        self.options.extra["vocab_limit"] = limit or self.config.vocab_size

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise InputError(describe("batch size", f"<= {self.buckets[-1]}", n))

    def _staging_for(self, bucket: int) -> ChainStaging:
        if bucket not in self._staging:
            self._staging[bucket] = self._new_staging(bucket)
        return self._staging[bucket]

    def _new_staging(self, bucket: int) -> ChainStaging:
        spec = hidden_spec(self.config, self.options.mode)
        words = (self.config.vocab_size + 31) // 32
        return ChainStaging(bucket, spec, self.cache.max_blocks_per_seq, words, self.device,
                            window=self.config.sliding_window, span=self.options.max_num_drafts - 1,
                            block_size=self.cache.block_size, kernel=self._kernel)

    # ---- executors -------------------------------------------------------------------------
    def _plan(self, n: int, k: int, masked: bool) -> LaunchPlan:
        """The bucket, staging and executor of a propose of n rows, K drafts: looked up once per generation."""
        plan = self._plans.get((n, k, masked))
        if plan is None or plan.generation != self.generation:
            bucket = self._bucket(n)
            executor = self._executor(bucket, k, masked)
            plan = self._plans[(n, k, masked)] = LaunchPlan(bucket, self._staging_for(bucket), executor,
                                                            self.generation,
                                                            not getattr(executor, "copies_staging", False),
                                                            is_gated(self.options.draft_conf_tau, k))
        plan.executor.tracer = self.tracer
        return plan

    def chain_spec(self, num_drafts: int, masked: bool = False) -> ChainSpec:
        """The K-draft chain's spec; K in 1..max_num_drafts (a larger one built a graph of K steps first)."""
        num_drafts = check_count(num_drafts, "num_drafts", 1, self.options.max_num_drafts)
        if not isinstance(masked, (bool, np.bool_)):
            raise InputError(describe("masked", "True or False", repr(masked)))
        ws = self.runner.workspace_bytes(self.buckets[-1]) if self.runner is not None else 0
        return ChainSpec(num_drafts=num_drafts, mode=self.options.mode, mtp_vocab_size=self.options.mtp_vocab_size,
                         masked=bool(masked), runner=runner_name(self.runner), runner_workspace_bytes=ws,
                         conf_tau=self.options.draft_conf_tau, numerics=self.numerics(), shard=self.shard)

    def numerics(self) -> Numerics:
        """The graphs' weight formats (from the bound weights), KV rounding and activations (options)."""
        return self._numerics_of(self.weights)

    def _numerics_of(self, weights: Mapping) -> Numerics:
        formats = weight_formats(weights)
        checkpoint_scaled = any(name != "head.weight" for name, _ in formats)  # an FP8 draft head: not the KV's cue
        return numerics_for(formats, self.options.kv_fp8_round_on(self.device, checkpoint_scaled),
                            self.options.activations)

    def _check_weights(self, weights: Mapping) -> None:
        """Prepared weights hold every tensor the one-draft chain binds, of its spec, on the device: an
        InputError naming the first problems now, not at the first propose (nothing is replaced)."""
        spec = dataclasses.replace(self.chain_spec(1), numerics=self._numerics_of(weights))
        bind_tensors(build_draft_chain(self.config, self.geometry, spec), weights, self.state_tensors, 1, self.device)

    def chain_graph(self, num_drafts: int, masked: bool = False):
        """The K-draft chain as declared (the executors run it after runtime/passes)."""
        return build_draft_chain(self.config, self.geometry, self.chain_spec(num_drafts, masked))

    def _executor(self, bucket: int, num_drafts: int, masked: bool):
        key = ("chain", bucket, num_drafts, masked, self.use_captured, self.options.draft_conf_tau)
        if key not in self._executors:
            graph = self.chain_graph(num_drafts, masked)
            # Captured, the chain starts with the staging copy and the hidden gather (no CUDA call before a
            # launch) and ends writing its drafts to pinned memory (no copy after it).
            staging = self._staging_for(bucket)
            prologue = staging.in_graph_copy(masked) if self.use_captured else None
            epilogue = staging.in_graph_read() if self.use_captured else None
            self._executors[key] = self._make_executor(graph, bucket, prologue, epilogue=epilogue)
        return self._checked(self._executors[key])

    def _checked(self, executor):
        if getattr(executor, "generation", self.generation) != self.generation:
            raise CaptureError("a stale executor (from before a runner swap or reload) was asked to run")
        executor.tracer = self.tracer
        return executor

    def _make_executor(self, graph, bucket: int, prologue=None, staging: ChainStaging | None = None, epilogue=None):
        runners = {runner_name(self.runner): RunnerNode(self.runner)} if self.runner is not None else {}
        runners.update(runners_for(self.rank_group))  # the comm nodes' RankGroup (sharded)
        if self.use_captured:
            from draftgraph.runtime.execution.captured import CapturedExecutor

            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            staged = (staging or self._staging_for(bucket)).graph_inputs()
            static = {n: staged[n] for n in graph.inputs}
            if "grammar_mask" in static:
                static["grammar_mask"] = staged["grammar_mask"][:, : graph.values["grammar_mask"].spec.shape[1]]
            executor = CapturedExecutor(graph, bucket, self.weights, self.state_tensors, device=self.device,
                                        runners=runners, static_inputs=static, pool=self._pool,
                                        kernels=self.options.kernels, prologue=prologue, epilogue=epilogue,
                                        overlap=self.options.overlap)
        else:
            executor = EagerExecutor(graph, bucket, self.weights, self.state_tensors, device=self.device,
                                     runners=runners, debug=self.options.debug, kernels=self.options.kernels,
                                     overlap=self.options.overlap)
        executor.generation = self.generation
        return executor

    @_serialized
    def capture(self, num_drafts: Sequence[int] = (1,), masked: bool = False) -> None:
        """Build (and on CUDA capture) the chain for every bucket, largest bucket first; ``num_drafts``
        is one K or several."""
        counts = [num_drafts] if isinstance(num_drafts, (int, np.integer)) else num_drafts
        if sequence_length(counts) is None:
            raise InputError(describe("num_drafts", "a K or a sequence of them", type(num_drafts).__name__))
        counts = [self.chain_spec(k, masked).num_drafts for k in counts]  # every K checked before any capture
        for bucket in sorted(self.buckets, reverse=True):
            for k in counts:
                executor = self._executor(bucket, k, masked)
                if hasattr(executor, "capture") and executor.cuda_graph is None:
                    executor.capture()

    @_serialized
    def drop_executors(self) -> None:
        """Forget every executor and captured graph: after a runner swap, new weights, config or buckets.

        The generation counter moves on, so an executor kept from before can never run again.
        """
        for executor in self._executors.values():
            release = getattr(executor, "release", None)
            if release is not None:
                release()
        self._executors.clear()
        self._plans.clear()
        self.generation += 1

    @_serialized
    def set_buckets(self, buckets: Sequence[int]) -> None:
        """A new bucket set: every captured graph is dropped."""
        buckets = check_buckets(buckets)
        if buckets[-1] * (_window_blocks(self.config, self.options) + 1) > self.cache.num_blocks:
            raise InputError(describe("largest bucket", f"one the cache pool ({self.cache.num_blocks} blocks) can "
                                      "serve", buckets[-1]))
        self.buckets = buckets
        self._size_batch_buffers()
        self._staging.clear()
        self._continuation_staging.clear()
        self.drop_executors()

    @_serialized
    def load_weights(self, tensors) -> None:
        """Replace the weights (same config): every captured graph is dropped. Weights the chain cannot
        bind are refused, and the ones it has stay."""
        weights = prepare_weights(self.config, tensors, self.device, weights=self.options.weights_on(self.device),
                                  shard=self.shard, head_dtype=self.options.head_dtype)
        self._check_weights(weights)
        self.weights = weights
        if self.runner is not None and hasattr(self.runner, "bind"):
            self.runner.bind(self.config, self.weights, self.device)
        self.drop_executors()

    # ---- verification and catch-up ---------------------------------------------------------------
    @_serialized
    def after_verify(self, num_accepted: int, state: MtpProposerState) -> None:
        """The seed's rollback: seq_len -= max(drafted, 1) - num_accepted (saturating).

        Once per propose: a second call, or one before any propose, raises InputError.
        """
        self._verify([num_accepted], [state], 1)

    @_serialized
    def after_verify_batch(self, num_accepted, states) -> None:
        """``after_verify`` of a batch's rows in one call (an engine verifies a batch at a time).

        ``num_accepted`` is B ints (numpy integers, an integer array); every state must have
        proposed since its last verify. All or nothing: any bad entry raises the error
        ``after_verify`` would give for it, and no row changes.
        """
        self._verify(num_accepted, states, states_length(states))

    def _verify(self, counts, states, n: int) -> None:
        """The one path of after_verify: the batch kernel's verify (checks, roll-back, blocks given back)."""
        keys, accepted = self._verify_arrays(counts, states, n)
        rows = self.rows
        with self.cache.lock:
            status, index, _ = self._kernel.verify(self._bound(), keys, accepted)
        if status == batch_kernel.OK:
            return
        if status in (batch_kernel.STALE, batch_kernel.TWICE):
            check_states(states, self.id, rows, n)  # raises the state's own error
        what = f"num_accepted[{index}]" if n > 1 else "num_accepted"
        if status == batch_kernel.COUNT:
            drafted = max(int(rows.last_drafted[keys[index] & batch_kernel.ROW_MASK]), 1)
            raise InputError(describe(what, f"an int in [0, {drafted}]", int(accepted[index]),
                                      "at most the drafts of the sequence's last propose"))
        if status == batch_kernel.UNPROPOSED:
            raise InputError(describe("after_verify" if n == 1 else f"after_verify of states[{index}]",
                                      "one call after each propose", "a call with no propose since the last one",
                                      "call it once per verify of the drafts a propose made"))
        raise AssertionError(f"the batch kernel's verify refused (status {status}, row {index}) a checked batch")

    def _verify_arrays(self, counts, states, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's keys and counts (int64 [n]); anything unusual through the item-by-item checks."""
        if n == 1 and type(counts) is list and len(counts) == 1 and type(counts[0]) is int:
            keys, accepted = self._verify_one
            try:
                keys[0], accepted[0] = states[0].key, counts[0]
                return keys, accepted
            except (TypeError, AttributeError, OverflowError, IndexError, KeyError):
                pass  # the checks below name what is wrong
        try:
            keys = np.fromiter(map(_KEY, states), np.int64, n)
        except (TypeError, ValueError, AttributeError):
            keys = check_states(states, self.id, self.rows, n)  # raises for the first bad state
        accepted = _int64_array(counts, n)
        if accepted is None:  # the kernel checks the keys; the counts that are no ints are named here
            drafted = np.maximum(self.rows.last_drafted[check_states(states, self.id, self.rows, n)
                                                        & batch_kernel.ROW_MASK], 1)
            accepted = check_ints(counts, "num_accepted", 0, int(drafted.max(initial=1)) + 1, n)
        return keys, accepted

    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: torch.Tensor, state) -> int:
        """Write drafter rows for the prompt: row i from (prompt_tokens[i + 1], hiddens[i]), i < P - 1.

        ``hiddens`` is one tensor [P, C, D] (streams) or [P, D] (collapsed), row i the target's
        hidden for prompt_tokens[i]. Returns the rows written (P - 1); the first propose then comes
        at position P - 1 with the token the target sampled after the prompt.
        """
        tokens = list(prompt_tokens) if sequence_length(prompt_tokens) else None
        if not tokens:
            raise InputError(describe("prefill_drafter prompt_tokens", "a non-empty sequence of token ids",
                                      repr(prompt_tokens)))
        if not isinstance(hiddens, torch.Tensor):
            raise InputError(describe("prefill_drafter hiddens", f"one tensor [{len(tokens)}, ...]",
                                      type(hiddens).__name__, "torch.stack a list of hiddens"))
        if hiddens.dim() == 0 or hiddens.shape[0] != len(tokens):
            raise InputError(describe("prefill_drafter hiddens", f"[{len(tokens)}, ...] (one per prompt token)",
                                      list(hiddens.shape)))
        return self.catchup_batch([tokens[1:]], [hiddens[:-1]], [0], [state])

    def catchup_drafter(self, tokens: Sequence[int], hiddens: torch.Tensor, row_base: int, pos_base: int,
                        state) -> int:
        """Write rows at positions pos_base.. from (tokens[k], hiddens[k]) pairs; returns rows written.

        Rows are position-indexed here, so ``row_base`` must equal ``pos_base``.
        """
        row_base = as_int(row_base, "catchup_drafter row_base", "an int")
        pos_base = as_int(pos_base, "catchup_drafter pos_base", "an int")
        if row_base != pos_base:
            raise InputError(describe("catchup_drafter row_base", f"pos_base ({pos_base}): rows are positions",
                                      row_base))
        return self.catchup_batch([tokens], [hiddens], [pos_base], [state])

    @_serialized
    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens, first_pos: Sequence[int], states,
                      assume_finite: bool = False) -> int:
        """Append rows for several sequences in one prefill run; ``hiddens[i]`` [n_i, ...] pairs ``tokens[i]``.

        Every input is checked before anything is written, the hiddens' finiteness too (one
        host sync for the call): a NaN or an infinity raises NonFiniteError and writes nothing.
        ``assume_finite``: the caller has checked that on the device (the device decode loop's
        verify does), so no sync.
        """
        rows = check_rows(self, tokens, hiddens, first_pos, states, assume_finite)
        if rows is None:
            return 0
        placed = place_rows(self, rows)
        try:
            write_in_prefill_runs(self, rows.which(), rows.positions(), placed.row_kv, rows.tokens, rows.hidden)
        except BaseException:
            placed.undo(self)
            raise
        for row, length in zip(rows.rows.tolist(), (rows.starts + rows.count).tolist()):
            self._trim(row, length)
        return rows.num_rows

    def _prefill_executor(self, bucket: int):
        key = ("prefill", bucket, self.use_captured)
        if key not in self._executors:
            ws = self.runner.workspace_bytes(self.buckets[-1]) if self.runner is not None else 0
            graph = build_drafter_prefill(self.config, self.geometry, self.options.mode, runner_name(self.runner), ws,
                                          self.numerics(), self.shard)
            self._executors[key] = self._make_executor(graph, bucket)
        return self._checked(self._executors[key])

    @_serialized
    def drafter_rows(self, state) -> int:
        """Valid drafter rows held (seq_len - kv_start)."""
        check_state(state, self.id, self.rows)
        return int(self.rows.seq_len[state.row] - self.rows.kv_start[state.row])

    @_serialized
    def last_pair_key(self, state) -> int | None:
        """Sequence position of the newest drafter row, None when there is none."""
        check_state(state, self.id, self.rows)
        seq_len, kv_start = int(self.rows.seq_len[state.row]), int(self.rows.kv_start[state.row])
        return seq_len - 1 if seq_len > kv_start else None

    # ---- carrying drafter KV between turns ----------------------------------------------------
    @_serialized
    def take_drafter_kv(self, state) -> CarriedKv | None:
        """Move the state's blocks out: returns (blocks, rows, last_pair_key); the state is as new."""
        check_state(state, self.id, self.rows)
        row, table = state.row, self.rows.table_of[state.row]
        if table.is_empty:
            return None
        key = self.last_pair_key(state)
        seq_len, kv_start = int(self.rows.seq_len[row]), int(self.rows.kv_start[row])
        taken = self.cache.take(table)
        self.rows.reset(row)
        self.rows.num_trimmed[row] = 0
        return CarriedKv(list(taken.blocks), seq_len, key, kv_start, taken)

    @_serialized
    def install_drafter_kv(self, state, blocks, rows: int, last_pair_key: int | None,
                           kv_start: int | None = None) -> bool:
        """Install carried blocks into a fresh state (the inverse of take). False when not possible."""
        check_state(state, self.id, self.rows)
        row, table = state.row, self.rows.table_of[state.row]
        taken = getattr(blocks, "taken", None) if isinstance(blocks, CarriedKv) else None
        if isinstance(blocks, CarriedKv):
            kv_start = blocks.kv_start if kv_start is None else kv_start
            blocks = blocks[0]
        count = check_count(rows, "install_drafter_kv rows", 0, self.max_seq_len)
        if kv_start is not None:
            kv_start = check_count(kv_start, "install_drafter_kv kv_start", 0, count)
        if not table.is_empty or self.rows.seq_len[row]:
            return False
        ids = tuple(int(b) for b in blocks if b >= 0)
        self.cache.install(table, taken or TakenBlocks(tuple(int(b) for b in blocks), ids, self.cache.cache_id))
        first_block = next((j for j, b in enumerate(blocks) if b >= 0), 0)
        self.rows.seq_len[row] = count
        self.rows.kv_start[row] = kv_start if kv_start is not None else first_block * self.cache.block_size
        self.rows.num_trimmed[row] = table.num_trimmed
        return True

    @_serialized
    def free_drafter_kv(self, blocks) -> None:
        """Release carried blocks no state owns."""
        if isinstance(blocks, CarriedKv):
            blocks = blocks.taken if blocks.taken is not None else blocks[0]
        if isinstance(blocks, TakenBlocks):
            self.cache.free_blocks(blocks)
            return
        if sequence_length(blocks) is None:
            raise InputError(describe("free_drafter_kv blocks", "what take_drafter_kv returned, or block ids",
                                      type(blocks).__name__))
        ids = [as_int(b, "free_drafter_kv blocks", "block ids (ints; -1: none)") for b in blocks]
        self.cache.free_blocks([b for b in ids if b >= 0])

    # ---- small queries (the seed's trait) -------------------------------------------------------
    def last_confidence(self) -> float | None:
        """Min top-1 probability over the last propose's drafts (when draft_conf_tau > 0), else None."""
        return self._last_confidence

    def block_gamma(self) -> None:
        return None

    def needs_comm(self) -> bool:
        """True when the layer is sharded over several ranks (its MoE and argmax reduce across them)."""
        return self.shard is not None

    def prefill_uses_shared_buffers(self) -> bool:
        """False: the drafter prefill runs on its own arena, never the target's buffers."""
        return False

    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """The hidden rows a prefill of up to ``max_seq_len`` tokens hands this proposer (the seed's query)."""
        return min(check_count(max_seq_len, "max_seq_len", 0, 1 << 62), self.max_seq_len)

    def _check_embed_target(self, target: object) -> None:
        """``draft_embed_target``: one contiguous embedding row (bf16, D values) on the device; checked
        before the run, so that a bad one changes no state."""
        table = self.weights["embed.weight"]
        if not isinstance(target, torch.Tensor) or target.numel() != table.shape[1] or target.dtype != table.dtype \
                or not target.is_contiguous() or not is_on(target, self.device):
            raise InputError(describe("draft_embed_target", f"one contiguous {table.dtype} row of {table.shape[1]} "
                                      f"values on {self.device}", f"{getattr(target, 'dtype', type(target).__name__)} "
                                      f"{list(getattr(target, 'shape', []))}"))

    def _leave_embedding(self, token: torch.Tensor, target: torch.Tensor) -> None:
        torch.index_select(self.weights["embed.weight"], 0, token.to(self.device), out=target.view(1, -1))
        self._deferred_token = token

    def read_deferred_draft_token(self) -> int:
        """The draft id whose embedding the last propose left in ``draft_embed_target``; 0 if none."""
        return int(self._deferred_token.item()) if self._deferred_token is not None else 0

    # ---- the circuit-draft binding -------------------------------------------------------------
    @_serialized
    def circuit_draft(self, num_drafts: int = 1) -> DraftBinding:
        from draftgraph.runtime.passes import run_passes
        from draftgraph.runtime.planning.graph_plan import plan_graph

        graph = self.chain_graph(num_drafts)
        ws = self.runner.workspace_bytes(self.buckets[-1]) if self.runner is not None else 0
        plan = plan_graph(run_passes(graph).graph, self.buckets[-1])  # the graph the executors run
        spec = hidden_spec(self.config, "streams")
        return DraftBinding(graph, self.weights, block_interface(self.config, self.geometry), TensorSpec(
            spec.shape, spec.dtype), runner_name(self.runner), ws, plan.arena_bytes)

    @_serialized
    def set_circuit_draft(self, runner) -> None:
        """Run ``runner`` (a DraftRunner, a shipped name or 'module:callable') as the body; None restores it.

        The chain is re-planned and every executor and captured graph is dropped.
        """
        if runner is not None and self.shard is not None:
            raise InputError(describe("set_circuit_draft on a sharded proposer", "None (the built-in body)",
                                      repr(runner), "a body runner would compute the whole MoE from this rank's "
                                      "experts only: run it unsharded"))
        loaded = load_runner(runner)
        if loaded is not None and hasattr(loaded, "bind"):
            loaded.bind(self.config, self.weights, self.device)
        self.runner = loaded
        self.drop_executors()
