"""DeepseekV4MtpProposer: the seed's DraftProposer over the graph executor.

A propose is ONE run of the K-draft chain graph: the K drafts chain on the
device (each argmax feeds the next embed, positions advance inside the graph)
and the host reads the K tokens back once, at the end (the seed reads after
every draft). Executors are made per (batch bucket, K, masked) and kept; the
captured executor (CUDA) and the eager one run the same graph on the same kind
of arena, behind the same API.

Drafter rows are position-indexed (see proposer_state.py). Pair semantics, as
in the seed: the row at position p is computed from the pair (token t_{p+1},
hidden of position p); ``propose(t, h, p, K)`` writes rows p .. p+K-1 (row p
from the target's hidden, later rows from the MTP's own hidden).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from draftgraph.graphs.draft_chain import (
    ChainSpec,
    build_draft_chain,
    build_drafter_prefill,
    hidden_spec,
    is_gated,
    mask_words,
)
from draftgraph.graphs.v4_block import CacheGeometry, block_interface
from draftgraph.ops.draft_gate import CUT
from draftgraph.runtime.cache.metadata import check_rows
from draftgraph.runtime.cache.paged_cache import BlockTable, PagedLatentCache
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.execution.eager import EagerExecutor, concrete_device
from draftgraph.runtime.execution.kernel_choice import check_kernels
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.proposer.binding import DraftBinding, prepare_weights
from draftgraph.runtime.proposer.checks import (
    check_batch,
    check_bitmask,
    check_hidden,
    check_hiddens,
    check_num_drafts,
    check_position,
    check_positions,
    check_state,
    check_states,
    check_token,
    check_tokens,
)
from draftgraph.runtime.proposer.front import commit_rows, kv_start_after, stage_ensured_rows, stage_front
from draftgraph.runtime.proposer.runners.base import RunnerNode, load_runner, runner_name
from draftgraph.runtime.proposer.state import MtpProposerState

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_ids = iter(range(1, 1 << 62))


def _scalars(state: MtpProposerState) -> tuple:
    """The state's fields besides its table (what a failed propose must leave as they were)."""
    return state.seq_len, state.kv_start, state.last_num_drafted, state.is_freed


class LaunchPlan(NamedTuple):
    """What a propose of one batch size, K and maskedness looks up (design note "launch plans")."""

    num_drafts: int
    bucket: int
    staging: ChainStaging
    executor: object
    generation: int  # the proposer's generation it was made in: stale once executors are dropped


class CarriedKv(tuple):
    """(blocks, rows, last_pair_key) as the seed's take_drafter_kv returns, plus ``kv_start``."""

    def __new__(cls, blocks, rows, last_pair_key, kv_start=0, taken=None):
        obj = super().__new__(cls, (blocks, rows, last_pair_key))
        obj.kv_start, obj.taken = kv_start, taken
        return obj


@dataclass
class ProposerOptions:
    mode: str = "streams"
    mtp_vocab_size: int = 0
    max_seq_len: int | None = None  # default: config.max_position_embeddings
    num_cache_blocks: int | None = None  # default: enough for max batch x window x max drafts
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_num_drafts: int = 8
    draft_conf_tau: float = 0.0  # > 0: stop drafting inside the chain once confidence < tau (fewer than K drafts)
    executor: str = "auto"  # "auto" (captured on CUDA), "eager", "captured"
    kernels: str = "auto"  # "auto" (fused on CUDA), "torch", "compiled" (draftgraph.runtime.execution.kernel_choice)
    overlap: bool = True  # on CUDA, ops may queue work that only later steps read on a side stream (ops.overlap)
    debug: bool = False
    poison_arena: bool = False  # fill the arena with NaN before every run (tests of invariant 3)
    extra: dict = field(default_factory=dict)


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
        self.options = options or ProposerOptions(**kw)
        opts = self.options
        if opts.mode not in ("streams", "collapsed"):
            raise InputError(describe("mode", "'streams' or 'collapsed'", repr(opts.mode)))
        check_kernels(opts.kernels)
        if not 0.0 <= opts.draft_conf_tau <= 1.0:
            raise InputError(describe("draft_conf_tau", "in [0, 1] (0: never stop early)", opts.draft_conf_tau))
        self.config = config
        self.device = concrete_device(device) if device is not None else torch.device("cpu")
        self.id = next(_ids)
        self.max_seq_len = opts.max_seq_len or config.max_position_embeddings
        self.buckets = tuple(sorted(set(opts.buckets)))
        blocks = opts.num_cache_blocks or self.buckets[-1] * (
            math.ceil((config.sliding_window + opts.max_num_drafts) / 16) + 2
        )
        self.cache = PagedLatentCache(config, blocks, max_seq_len=self.max_seq_len, device=self.device)
        self.geometry = CacheGeometry(self.cache.kv.shape[0], self.cache.max_blocks_per_seq, self.cache.block_size)
        self.weights = prepare_weights(config, tensors, self.device)
        self.state_tensors = {"mtp.0.kv_cache": self.cache.kv}
        self.runner = None
        self._executors: dict[tuple, object] = {}
        self._staging: dict[int, ChainStaging] = {}
        # (batch, K, masked) -> a propose's lookups (design note "launch plans" in _propose)
        self._plans: dict[tuple[int, int, bool], LaunchPlan] = {}
        self._last_confidence: float | None = None
        self._deferred_token: torch.Tensor | None = None
        self.last_propose_seconds = 0.0
        self.last_host_seconds = 0.0
        self.last_outputs: dict[str, torch.Tensor] = {}
        self.tracer = None  # draftgraph.tools.trace.Tracer, set by attach(); handed to every executor
        self.generation = 0  # bumped whenever executors are dropped; a stale executor never runs
        self._pool = None  # one CUDA graph memory pool shared by every capture
        self.use_captured = opts.executor == "captured" or (opts.executor == "auto" and self.device.type == "cuda")

    @staticmethod
    def from_checkpoint(path: str | Path, device=None, **kw) -> DeepseekV4MtpProposer:
        from draftgraph.runtime.model.weights import load_checkpoint

        ckpt = load_checkpoint(path, device="cpu")
        return DeepseekV4MtpProposer(ckpt.config, ckpt.tensors, device=device, **kw)

    # ---- state -------------------------------------------------------------------------------
    def alloc_state(self) -> MtpProposerState:
        return self.alloc_state_for(None)

    def alloc_state_for(self, budget_tokens: int | None) -> MtpProposerState:
        """A fresh state; ``budget_tokens`` (prompt + max tokens) bounds its positions (None = max)."""
        if budget_tokens is not None and (not isinstance(budget_tokens, int) or budget_tokens < 1):
            raise InputError(describe("budget_tokens", "an int >= 1 or None", repr(budget_tokens)))
        limit = self.max_seq_len if budget_tokens is None else min(budget_tokens, self.max_seq_len)
        return MtpProposerState(table=BlockTable(block_size=self.cache.block_size), max_positions=limit, owner=self.id)

    def free_state(self, state: MtpProposerState) -> None:
        """Return every block the state holds; the state cannot be used again."""
        check_state(state, self.id)
        self.cache.free(state.table)
        state.reset()
        state.is_freed = True

    # ---- propose -----------------------------------------------------------------------------
    def propose(self, last_token, target_hidden, position, num_drafts, state, grammar_bitmask=None,
                draft_embed_target: torch.Tensor | None = None) -> list[int]:
        """Draft ``num_drafts`` tokens after ``last_token`` (t_{p+1}) given the target's hidden at ``position`` (p).

        The hidden is [C, D] (streams mode: the target's pre-hc_head streams) or [D]
        (collapsed). One run of the K-draft chain; the K tokens are read back once.
        A grammar bitmask (int32 words, bit t of word t // 32) is applied on the
        device to every draft; one that allows nothing gives draft 0 and a warning.
        With ``draft_embed_target`` the last draft's embedding row is left there (on
        the device) and ``read_deferred_draft_token()`` returns its id.
        """
        drafted = self._propose([last_token], [target_hidden], [position], num_drafts, [state], grammar_bitmask)
        if draft_embed_target is not None:  # the last draft kept (fewer than K when confidence gated)
            self._leave_embedding(self.last_outputs["drafts"][:1, len(drafted[0]) - 1], draft_embed_target)
        return drafted[0]

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states, out_conf=None):
        """B sequences in one chain run (weights read once per draft position); equals B ``propose`` calls.

        ``target_hiddens`` is either a sequence of B hiddens, each as ``propose`` takes it, or
        one bf16 tensor [B, C, D] (streams) or [B, D] (collapsed) on the proposer's device, as
        vLLM and SGLang hold them: checked once and staged as one block, with no work per row.
        ``out_conf``, a list, receives each sequence's per-draft top-1 probabilities.

        Example
        -------
        >>> prop.propose_batch([5, 17], torch.stack([h0, h1]), [40, 9], 3, [s0, s1])  # doctest: +SKIP
        """
        n = len(last_tokens)
        if not isinstance(target_hiddens, torch.Tensor):  # a tensor's [B, ...] shape is checked in _propose
            check_batch("target_hiddens", target_hiddens, n)
        for name, items in (("positions", positions), ("states", states)):
            check_batch(name, items, n)
        if not 1 <= n <= self.propose_batch_max():
            raise InputError(describe("batch size", f"1..{self.propose_batch_max()} (propose_batch_max)", n))
        drafts = self._propose(last_tokens, target_hiddens, positions, num_drafts, states, None)
        if out_conf is not None:
            probs = self.last_outputs["probs"]
            out_conf.clear()
            out_conf.extend(probs[i, : len(row)].tolist() for i, row in enumerate(drafts))
        return drafts

    def propose_batch_max(self) -> int:
        return self.buckets[-1]

    def _propose(self, tokens, hiddens, positions, num_drafts, states, bitmask):
        entered = time.perf_counter()
        n = len(tokens)
        vocab, shape, words = self._propose_constants()
        # Design note "launch plans": the checked K, the bucket, its staging and its executor
        # are the same for every propose of a batch size, K and maskedness until executors are
        # dropped (the generation moves on). Looked up once, they save ~2 us of checks and
        # lookups on the CI machine (~5 on the H200 hosts). An int K only: True == 1 as a key.
        plan = self._plans.get((n, num_drafts, bitmask is not None)) if type(num_drafts) is int else None
        if plan is not None and plan.generation == self.generation:
            k, bucket, staging, executor = plan.num_drafts, plan.bucket, plan.staging, plan.executor
            executor.tracer = self.tracer
        else:
            k = check_num_drafts(num_drafts, self.options.max_num_drafts)
            bucket = self._bucket(n)
            staging, executor = self._staging_for(bucket), None  # the executor once the inputs passed
        # The hiddens and the mask first, so that a batch refused for them has mapped no block;
        # but the error is the first kind's, as item by item: states, tokens, positions, hiddens.
        try:
            hiddens = check_hiddens(hiddens, shape, self.device, n)  # a list, or one [n, ...] tensor
            mask = self._checked_mask(bitmask, words)
        except InputError:
            checked = check_states(states, self.id)
            check_tokens(tokens, vocab)
            check_positions(positions, k, checked)
            raise
        staging.wait_for_copy()  # the host buffer is written from here on
        # Design notes "one pass" and "compiled front" (draftgraph.runtime.proposer.front): the usual batch is
        # checked, ensured and staged in one call; anything else goes item by item, as it always did.
        front = stage_front(staging, self.cache, states, tokens, positions, k, self.id, vocab)
        undo: list[tuple] = []
        if front is None:
            states = check_states(states, self.id)
            tables = [state.table for state in states]
            are_distinct = self._are_tables_distinct(states, tables)
            tokens = check_tokens(tokens, vocab)
            positions = check_positions(positions, k, states)
        elif front.records:  # blocks the front mapped: a refusal from here on gives them back
            undo = [(states[i], length, new) for i, length, new in front.records]
        try:
            if front is None:
                undo = self._ensure_undoable(states, tables, positions, k, are_distinct)
                self._stage_rows(staging, states, positions, tables)
            else:
                tables = None  # made after the launch, for the trim (host time)
                if not front.done:
                    rows = front.unheld
                    if rows:
                        tables = [state.table for state in states]
                        if front.records is None:
                            undo = self._ensure_undoable(states, tables, positions, k, rows=rows)
                        if not stage_ensured_rows(staging.writer, self.cache, states, tokens, positions, k, self.id,
                                                  vocab, rows):
                            ensured = self._checked_rows([states[i] for i in rows], [positions[i] for i in rows],
                                                         [tables[i] for i in rows])
                            if ensured is None:  # a table of another type or edited by hand: the general path's rows
                                self._stage_rows(staging, states, positions, tables)
                            else:
                                staging.writer.write_rows_at(rows, ensured)
                    staging.writer.write_padding_from(n)
            start = time.perf_counter()
            if executor is None:
                executor = self._executor(bucket, k, mask is not None)
                self._plans[(n, k, mask is not None)] = LaunchPlan(k, bucket, staging, executor, self.generation)
            staging.stage_after_rows(tokens, hiddens, self._vocab_limit(), [mask] * n if mask is not None else None,
                                     copy_in=not getattr(executor, "copies_staging", False),
                                     tokens_written=front is not None and front.done)
            if self.options.poison_arena:
                executor.poison()
            outputs = executor.run(staging.chain_inputs(words if mask is not None else None), check=False)
            self.last_host_seconds = time.perf_counter() - entered  # host work up to the (async) launch
            drafts = staging.read_rows(outputs["drafts"], n)  # the one device-to-host read of the K tokens
            self.last_outputs = outputs
            self.last_propose_seconds = time.perf_counter() - start
        except BaseException:
            for record in reversed(undo):
                self._undo_ensure(*record)
            if front is not None:  # the rows the pass staged, as they were (once no copy reads them)
                staging.wait_for_copy()
                staging.writer.restore()
            raise
        drafted = drafts.tolist()
        if is_gated(self.options.draft_conf_tau, k):  # a cut draft is -1, and so are all after it
            drafted = [row[: row.index(CUT)] if CUT in row else row for row in drafted]
        short, committed = commit_rows(states, positions, drafted, k)
        for i in short:  # the blocks ensured for the drafts the chain did not make go back
            self.cache.truncate(states[i].table, states[i].seq_len)
        self.cache.trim_batch(tables if tables is not None else committed, positions)
        if self.options.draft_conf_tau > 0:
            self._last_confidence = self._chain_confidence(outputs["probs"][:n], [len(row) for row in drafted])
        else:
            self._last_confidence = None
        return drafted  # the device outputs stay in last_outputs (slicing them costs a dispatch each)

    @staticmethod
    def _chain_confidence(probs: torch.Tensor, kept: list[int]) -> float:
        """Min top-1 probability over the drafts each row kept (the probs of cut drafts are stale)."""
        if min(kept) == probs.shape[1]:
            return float(probs.amin())
        host = probs.cpu()
        return min(float(host[i, :m].amin()) for i, m in enumerate(kept))

    def _propose_constants(self) -> tuple[int, tuple[int, ...], int]:
        """(vocab size, hidden shape per sequence, drafted mask words), kept while config and options hold."""
        key = (self.config, self.options.mode, self.options.mtp_vocab_size)
        cached = self.__dict__.get("_propose_constants_cache")
        if cached is None or cached[0] != key:
            shape = tuple(hidden_spec(self.config, self.options.mode).shape[1:])
            words = mask_words(self.config, self.options.mtp_vocab_size)
            cached = self.__dict__["_propose_constants_cache"] = (key, (self.config.vocab_size, shape, words))
        return cached[1]

    def _checked_mask(self, bitmask, words: int) -> torch.Tensor | None:
        """The grammar mask cut to the drafted vocab rows (None when there is none); warns when it allows nothing."""
        if bitmask is None:
            return None
        mask = check_bitmask(bitmask, (self.config.vocab_size + 31) // 32)[:words]
        if not bool(mask.ne(0).any()):
            warnings.warn("grammar mask allows no token: the drafts are 0 (pad drafts, rejected at verify)",
                          stacklevel=4)
        return mask

    @staticmethod
    def _are_tables_distinct(states: list[MtpProposerState], tables: list[BlockTable]) -> bool:
        """Whether no two (checked) states share a table; raises for a state given twice.

        One set of the tables answers both for the usual batch: distinct tables are distinct
        states. Distinct states sharing a table (one set by hand) are for ``ensure_batch`` to refuse.
        """
        if len(tables) == 1 or len(set(map(id, tables))) == len(tables):
            return True
        if len(set(map(id, states))) != len(states):
            raise InputError(describe("states", "distinct states", "the same state twice"))
        return False

    def _stage_rows(self, staging: ChainStaging, states: list[MtpProposerState], positions: list[int],
                    tables: list[BlockTable]) -> None:
        """Stage every row's metadata (the general path)."""
        rows = self._checked_rows(states, positions, tables)
        are_rows_checked = rows is not None
        if not are_rows_checked:  # a row the staging's checks refuse: they raise its error
            rows = self._metadata_rows(states, positions, tables)
        staging.writer.write(rows if are_rows_checked else check_rows(rows, staging.max_blocks))

    def _checked_rows(self, states: list[MtpProposerState], positions: list[int],
                      tables: list[BlockTable]) -> list | None:
        """``_metadata_rows`` in ``check_rows``' form, checked as it does, or None when a row fails.

        After ensure every row passes, so a propose stages them unchecked: one loop that knows its
        rows' types instead of check_rows' general one. None leaves the error to the staging's checks.
        """
        max_blocks, rows = self.geometry.max_blocks_per_seq, []
        for state, p, table in zip(states, positions, tables):
            kv_start = kv_start_after(state, p)
            blocks, block_size = table.blocks, table.block_size
            j = p // block_size
            if kv_start < 0 or type(blocks) is not list or not j < len(blocks) <= max_blocks or blocks[j] < 0:
                return None
            rows.append((p, kv_start, blocks, block_size))
        return rows

    @staticmethod
    def _metadata_rows(states: list[MtpProposerState], positions: list[int], tables: list[BlockTable]) -> list:
        """(p, kv_start after this propose, table) per sequence: the rows to stage (``kv_start_after``)."""
        return [(p, kv_start_after(s, p), t) for s, p, t in zip(states, positions, tables)]

    def _ensure_undoable(self, states: list[MtpProposerState], tables: list[BlockTable], positions: list[int],
                         k: int, are_distinct: bool = True, rows: list[int] | None = None) -> list[tuple]:
        """``cache.ensure`` of positions p..p+k-1 for every state (all or nothing), and the undo records.

        Only a row that got blocks has a record: its table's old length and the new block ids, not
        a copy of the table (a long sequence's table is thousands of entries). In the usual step
        every range is held already (design note "held rows" in :mod:`draftgraph.runtime.cache.paged_cache`).
        """
        if len(states) == 1:  # one sequence: the plain ensure (no batch bookkeeping)
            state, length, p = states[0], len(tables[0].blocks), positions[0]
            new = self.cache.ensure(tables[0], p, p + k - 1)
            return [(state, length, new)] if new else []
        if not are_distinct:  # distinct states sharing a table: ensure_batch refuses them, as it always did
            self.cache.ensure_batch(tables, positions, [p + k - 1 for p in positions])
        records = self.cache.ensure_unheld(tables, positions, k, rows)
        return [(states[i], length, new) for i, length, new in records]

    def _undo_ensure(self, state: MtpProposerState, length: int, new: list[int]) -> None:
        """Give back the blocks ensure added and the table's old length (the state's other fields untouched)."""
        scalars, blocks = _scalars(state), state.table.blocks
        self.cache._release(state.table, [blocks.index(b) for b in new])  # each id is in one entry only
        del blocks[length:]
        restored = (len(blocks), [b for b in new if b in blocks], _scalars(state))
        assert restored == (length, [], scalars), f"state not restored: {restored} != {(length, [], scalars)}"

    def last_hidden(self, n: int = 1) -> torch.Tensor:
        """A copy of the last propose's final hidden (streams or h_out) for its first ``n`` rows.

        Confidence-gated (draft_conf_tau > 0), it is the hidden of the last of the K steps, and
        stale when the chain stopped before that step.
        """
        return self.last_outputs[list(self.last_outputs)[2]][:n].clone()

    def _restore_blocks(self, state: MtpProposerState, before: list[int]) -> None:
        new = [j for j, b in enumerate(state.table.blocks) if b >= 0 and (j >= len(before) or before[j] < 0)]
        self.cache._release(state.table, new)
        del state.table.blocks[len(before):]

    def _graph_inputs(self, staged: dict, masked: bool) -> dict:
        names = ["token", "hidden", "positions", "kv_start", "block_table", "vocab_limit"]
        inputs = {n: staged[n] for n in names}
        if masked:
            words = mask_words(self.config, self.options.mtp_vocab_size)
            inputs["grammar_mask"] = staged["grammar_mask"][:, :words]
        return inputs

    def _vocab_limit(self) -> int:
        return self.options.extra.get("vocab_limit", self.config.vocab_size)

    def set_vocab_limit(self, limit: int | None) -> None:
        """Draft only tokens below ``limit`` (a device value: no re-capture)."""
        if limit is not None and not 1 <= limit <= self.config.vocab_size:
            raise InputError(describe("vocab_limit", f"1..{self.config.vocab_size}", limit))
        self.options.extra["vocab_limit"] = limit or self.config.vocab_size

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise InputError(describe("batch size", f"<= {self.buckets[-1]}", n))

    def _staging_for(self, bucket: int) -> ChainStaging:
        if bucket not in self._staging:
            spec = hidden_spec(self.config, self.options.mode)
            words = (self.config.vocab_size + 31) // 32
            self._staging[bucket] = ChainStaging(bucket, spec, self.cache.max_blocks_per_seq, words, self.device,
                                                 window=self.config.sliding_window)
        return self._staging[bucket]

    # ---- executors -------------------------------------------------------------------------
    def chain_spec(self, num_drafts: int, masked: bool = False) -> ChainSpec:
        ws = self.runner.workspace_bytes(self.buckets[-1]) if self.runner is not None else 0
        return ChainSpec(num_drafts=num_drafts, mode=self.options.mode, mtp_vocab_size=self.options.mtp_vocab_size,
                         masked=masked, runner=runner_name(self.runner), runner_workspace_bytes=ws,
                         conf_tau=self.options.draft_conf_tau)

    def chain_graph(self, num_drafts: int, masked: bool = False):
        return build_draft_chain(self.config, self.geometry, self.chain_spec(num_drafts, masked))

    def _executor(self, bucket: int, num_drafts: int, masked: bool):
        key = ("chain", bucket, num_drafts, masked, self.use_captured, self.options.draft_conf_tau)
        if key not in self._executors:
            graph = self.chain_graph(num_drafts, masked)
            # Captured, the chain starts with the staging copy and the hidden gather: no CUDA call before a launch.
            prologue = self._staging_for(bucket).in_graph_copy(masked) if self.use_captured else None
            self._executors[key] = self._make_executor(graph, bucket, prologue)
        return self._checked(self._executors[key])

    def _checked(self, executor):
        if getattr(executor, "generation", self.generation) != self.generation:
            from draftgraph.runtime.errors import CaptureError

            raise CaptureError("a stale executor (from before a runner swap or reload) was asked to run")
        executor.tracer = self.tracer
        return executor

    def _make_executor(self, graph, bucket: int, prologue=None):
        runners = {runner_name(self.runner): RunnerNode(self.runner)} if self.runner is not None else {}
        if self.use_captured:
            from draftgraph.runtime.execution.captured import CapturedExecutor

            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            staged = self._staging_for(bucket).graph_inputs()
            static = {n: staged[n] for n in graph.inputs}
            if "grammar_mask" in static:
                static["grammar_mask"] = staged["grammar_mask"][:, : graph.values["grammar_mask"].spec.shape[1]]
            executor = CapturedExecutor(graph, bucket, self.weights, self.state_tensors, device=self.device,
                                        runners=runners, static_inputs=static, pool=self._pool,
                                        kernels=self.options.kernels, prologue=prologue,
                                        overlap=self.options.overlap)
        else:
            executor = EagerExecutor(graph, bucket, self.weights, self.state_tensors, device=self.device,
                                     runners=runners, debug=self.options.debug, kernels=self.options.kernels,
                                     overlap=self.options.overlap)
        executor.generation = self.generation
        return executor

    def capture(self, num_drafts: Sequence[int] = (1,), masked: bool = False) -> None:
        """Build (and on CUDA capture) the chain for every bucket, largest bucket first."""
        for bucket in sorted(self.buckets, reverse=True):
            for k in num_drafts:
                executor = self._executor(bucket, k, masked)
                if hasattr(executor, "capture") and executor.cuda_graph is None:
                    executor.capture()

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

    def set_buckets(self, buckets: Sequence[int]) -> None:
        """A new bucket set: every captured graph is dropped."""
        if not buckets or any((not isinstance(b, int)) or b < 1 for b in buckets):
            raise InputError(describe("buckets", "ints >= 1", list(buckets)))
        if max(buckets) * (math.ceil((self.config.sliding_window + self.options.max_num_drafts) / 16) + 1) > \
                self.cache.num_blocks:
            raise InputError(describe("largest bucket", f"one the cache pool ({self.cache.num_blocks} blocks) can "
                                      "serve", max(buckets)))
        self.buckets = tuple(sorted(set(buckets)))
        self._staging.clear()
        self.drop_executors()

    def load_weights(self, tensors) -> None:
        """Replace the weights (same config): every captured graph is dropped."""
        self.weights = prepare_weights(self.config, tensors, self.device)
        if self.runner is not None and hasattr(self.runner, "bind"):
            self.runner.bind(self.config, self.weights, self.device)
        self.drop_executors()

    # ---- verification and catch-up ---------------------------------------------------------------
    def after_verify(self, num_accepted: int, state: MtpProposerState) -> None:
        """The seed's rollback: seq_len -= max(drafted, 1) - num_accepted (saturating)."""
        check_state(state, self.id)
        if not isinstance(num_accepted, int) or not 0 <= num_accepted <= max(state.last_num_drafted, 1):
            raise InputError(describe("num_accepted", f"an int in [0, {max(state.last_num_drafted, 1)}]",
                                      repr(num_accepted)))
        trim = max(state.last_num_drafted, 1) - num_accepted
        if trim > 0:
            state.seq_len = max(state.seq_len - trim, state.kv_start)
            self.cache.truncate(state.table, state.seq_len)

    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: torch.Tensor, state) -> int:
        """Write drafter rows for the prompt: row i from (prompt_tokens[i + 1], hiddens[i]), i < P - 1.

        ``hiddens`` is [P, C, D] (streams) or [P, D] (collapsed), row i the target's hidden
        for prompt_tokens[i]. Returns the rows written (P - 1); the first propose then comes
        at position P - 1 with the token the target sampled after the prompt.
        """
        tokens = list(prompt_tokens)
        if len(tokens) < 1 or hiddens.shape[0] != len(tokens):
            raise InputError(describe("prefill_drafter hiddens", f"[{len(tokens)}, ...] (one per prompt token)",
                                      list(hiddens.shape)))
        return self.catchup_drafter(tokens[1:], hiddens[:-1], 0, 0, state)

    def catchup_drafter(self, tokens: Sequence[int], hiddens: torch.Tensor, row_base: int, pos_base: int,
                        state) -> int:
        """Write rows at positions pos_base.. from (tokens[k], hiddens[k]) pairs; returns rows written.

        Rows are position-indexed here, so ``row_base`` must equal ``pos_base``.
        """
        if row_base != pos_base:
            raise InputError(describe("catchup_drafter row_base", f"pos_base ({pos_base}): rows are positions",
                                      row_base))
        return self.catchup_batch([list(tokens)], [hiddens], [pos_base], [state])

    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens, first_pos: Sequence[int], states) -> int:
        """Append rows for several sequences in one prefill run; ``hiddens[i]`` [n_i, ...] pairs ``tokens[i]``."""
        n = len(tokens)
        check_batch("hiddens", hiddens, n)
        check_batch("first_pos", first_pos, n)
        check_batch("states", states, n)
        states = [check_state(s, self.id) for s in states]
        shape = hidden_spec(self.config, self.options.mode).shape[1:]
        flat: list[tuple[MtpProposerState, int, int, torch.Tensor]] = []
        for toks, hs, p0, state in zip(tokens, hiddens, first_pos, states):
            if len(toks) == 0:
                continue
            if not isinstance(hs, torch.Tensor) or hs.shape[0] != len(toks):
                raise InputError(describe("catch-up hiddens", f"[{len(toks)}, *{list(shape)}]",
                                          getattr(hs, "shape", type(hs).__name__)))
            check_position(p0, len(toks), state, "first_pos")
            for j, tok in enumerate(toks):
                flat.append((state, p0 + j, check_token(tok, self.config.vocab_size, "catch-up token"),
                             check_hidden(hs[j], shape, self.device, "catch-up hidden")))
        if not flat:
            return 0
        snapshots = [(s, s.snapshot(), list(s.table.blocks)) for s in states]
        try:
            for toks, p0, state in zip(tokens, first_pos, states):
                if toks:
                    self.cache.ensure(state.table, p0, p0 + len(toks) - 1)
            starts = {}
            for toks, p0, state in zip(tokens, first_pos, states):
                if toks:
                    starts[id(state)] = p0 if (p0 > state.seq_len or p0 < state.kv_start) else state.kv_start
            chunk = self.buckets[-1]
            for at in range(0, len(flat), chunk):
                part = flat[at : at + chunk]
                bucket = self._bucket(len(part))
                rows = [(p, starts[id(s)], s.table) for s, p, _, _ in part]
                staged = self._staging_for(bucket).stage(rows, [t for _, _, t, _ in part], [h for *_, h in part],
                                                         self._vocab_limit())
                self._prefill_executor(bucket).run(
                    {k: staged[k] for k in ("token", "hidden", "positions", "kv_start", "block_table")}, check=False)
        except BaseException:
            for state, _, before in snapshots:
                self._restore_blocks(state, before)
            raise
        for toks, p0, state in zip(tokens, first_pos, states):
            if toks:
                state.kv_start, state.seq_len = starts[id(state)], p0 + len(toks)
                self.cache.trim_window(state.table, state.seq_len)
        return len(flat)

    def _prefill_executor(self, bucket: int):
        key = ("prefill", bucket, self.use_captured)
        if key not in self._executors:
            ws = self.runner.workspace_bytes(self.buckets[-1]) if self.runner is not None else 0
            graph = build_drafter_prefill(self.config, self.geometry, self.options.mode, runner_name(self.runner), ws)
            self._executors[key] = self._make_executor(graph, bucket)
        return self._checked(self._executors[key])

    def drafter_rows(self, state) -> int:
        """Valid drafter rows held (seq_len - kv_start)."""
        check_state(state, self.id)
        return state.seq_len - state.kv_start

    def last_pair_key(self, state) -> int | None:
        """Sequence position of the newest drafter row, None when there is none."""
        check_state(state, self.id)
        return state.seq_len - 1 if state.seq_len > state.kv_start else None

    # ---- carrying drafter KV between turns ----------------------------------------------------
    def take_drafter_kv(self, state) -> CarriedKv | None:
        """Move the state's blocks out: returns (blocks, rows, last_pair_key); the state is as new."""
        check_state(state, self.id)
        if state.table.is_empty:
            return None
        key = self.last_pair_key(state)
        taken = self.cache.take(state.table)
        carried = CarriedKv(list(taken.blocks), state.seq_len, key, state.kv_start, taken)
        state.reset()
        return carried

    def install_drafter_kv(
        self, state, blocks, rows: int, last_pair_key: int | None, kv_start: int | None = None
    ) -> bool:
        """Install carried blocks into a fresh state (the inverse of take). False when not possible."""
        check_state(state, self.id)
        taken = getattr(blocks, "taken", None) if isinstance(blocks, CarriedKv) else None
        if isinstance(blocks, CarriedKv):
            kv_start = blocks.kv_start if kv_start is None else kv_start
            blocks = blocks[0]
        if not state.table.is_empty or state.seq_len:
            return False
        from draftgraph.runtime.cache.paged_cache import TakenBlocks

        ids = tuple(b for b in blocks if b >= 0)
        taken = taken or TakenBlocks(tuple(blocks), ids, self.cache.cache_id)
        self.cache.install(state.table, taken)
        first_block = next((j for j, b in enumerate(blocks) if b >= 0), 0)
        state.seq_len = rows
        state.kv_start = kv_start if kv_start is not None else first_block * self.cache.block_size
        return True

    def free_drafter_kv(self, blocks) -> None:
        """Release carried blocks no state owns."""
        if isinstance(blocks, CarriedKv):
            blocks = blocks[0]
        self.cache.free_blocks([b for b in blocks if b >= 0])

    # ---- small queries (the seed's trait) -------------------------------------------------------
    def last_confidence(self) -> float | None:
        """Min top-1 probability over the last propose's drafts (when draft_conf_tau > 0), else None."""
        return self._last_confidence

    def block_gamma(self) -> None:
        return None

    def needs_comm(self) -> bool:
        return False

    def prefill_uses_shared_buffers(self) -> bool:
        """False: the drafter prefill runs on its own arena, never the target's buffers."""
        return False

    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        return min(max_seq_len, self.max_seq_len)

    def _leave_embedding(self, token: torch.Tensor, target: torch.Tensor) -> None:
        table = self.weights["embed.weight"]
        if target.shape[-1] != table.shape[1] or target.dtype != table.dtype:
            raise InputError(describe("draft_embed_target", f"bf16 [..., {table.shape[1]}]",
                                      f"{target.dtype} {list(target.shape)}"))
        torch.index_select(table, 0, token.to(self.device), out=target.view(1, -1))
        self._deferred_token = token

    def read_deferred_draft_token(self) -> int:
        """The draft id whose embedding the last propose left in ``draft_embed_target``; 0 if none."""
        return int(self._deferred_token.item()) if self._deferred_token is not None else 0

    # ---- the circuit-draft binding -------------------------------------------------------------
    def circuit_draft(self, num_drafts: int = 1) -> DraftBinding:
        from draftgraph.runtime.passes import run_passes
        from draftgraph.runtime.planning.graph_plan import plan_graph

        graph = self.chain_graph(num_drafts)
        ws = self.runner.workspace_bytes(self.buckets[-1]) if self.runner is not None else 0
        plan = plan_graph(run_passes(graph).graph, self.buckets[-1])  # the graph the executors run
        spec = hidden_spec(self.config, "streams")
        return DraftBinding(graph, self.weights, block_interface(self.config, self.geometry), TensorSpec(
            spec.shape, spec.dtype), runner_name(self.runner), ws, plan.arena_bytes)

    def set_circuit_draft(self, runner) -> None:
        """Run ``runner`` (a DraftRunner, a shipped name or 'module:callable') as the body; None restores it.

        The chain is re-planned and every executor and captured graph is dropped.
        """
        loaded = load_runner(runner)
        if loaded is not None and hasattr(loaded, "bind"):
            loaded.bind(self.config, self.weights, self.device)
        self.runner = loaded
        self.drop_executors()
