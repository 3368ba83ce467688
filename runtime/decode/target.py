"""TargetModel: the small V4-shaped target of the decode loop, run as one graph per row bucket.

The target graph (graphs/target.py) takes R token rows; rows of one sequence
share a block table and sit at consecutive positions, so a whole prompt, or a
verify window of K + 1 tokens for EVERY live sequence, is one graph run
(note "rows are tokens" there). Runs are padded to a row bucket; padded rows
are dead (block table -1: they write and read nothing).

Cache (note "one pool, L layers"): one :class:`PagedLatentCache` hands out
block ids and holds layer 0's rows; layers 1..L-1 have kv tensors of the same
shape indexed by the same block ids. A sequence has one block table for all
its layers, so the pool's free count is the free count of every layer.

Per-sequence state is a :class:`TargetSeqState`: its block table and its
length (positions 0 .. length-1 hold rows of tokens the target has seen).
``forward`` appends rows at ``length``; ``truncate`` rolls back (after a
rejected draft) and recycles the blocks outside the sliding window.

Example
-------
>>> target = TargetModel.from_checkpoint("ckpt/", executor="eager")     # doctest: +SKIP
>>> state = target.alloc_state()                                        # doctest: +SKIP
>>> out = target.prefill(state, [256, 104, 105])                        # doctest: +SKIP
>>> out.tokens[-1], out.hiddens.shape                                   # doctest: +SKIP
(32, torch.Size([3, 4, 128]))
>>> target.free(state)                                                  # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from draftgraph.graphs.target import build_target, layer_cache_name
from draftgraph.graphs.v4_block import CacheGeometry
from draftgraph.runtime.cache.paged_cache import BlockTable, PagedLatentCache
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.device import concrete_device
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.native import batch_kernel
from draftgraph.runtime.proposer.binding import prepare_weights
from draftgraph.runtime.proposer.checks import known_buckets, sequence_length

DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_ids = iter(range(1, 1 << 62))


@dataclass
class TargetSeqState:
    """One sequence of the target: block table (shared by all layers) and committed length."""

    table: BlockTable = field(default_factory=BlockTable)
    length: int = 0  # positions 0 .. length-1 hold rows of tokens the target has seen
    max_positions: int = 0  # positions this sequence may reach (its token budget)
    owner: int = 0
    is_freed: bool = False


@dataclass
class TargetOutput:
    """What the target computed for one sequence's rows (row j = position start + j).

    logits : f32 [T, V] on the model's device.
    hiddens : the MTP's input per row, bf16 [T, C, D] (streams) or [T, D] (collapsed), on the device.
    tokens : argmax of each row's logits (the greedy next token), host ints.
    """

    logits: torch.Tensor
    hiddens: torch.Tensor
    tokens: list[int]


class TargetModel:
    """The target model over its own paged caches; eager or CUDA-graph executors per row bucket.

    Parameters
    ----------
    config, tensors : the model config and its checkpoint tensors (``TARGET_TENSOR_NAMES``).
    device : where weights, caches and runs live (default cpu).
    mode : ``"streams"`` (hidden = pre-hc_head streams) or ``"collapsed"`` (hc_head output);
        must match the proposer's mode.
    executor : ``"eager"``, ``"captured"`` (CUDA graphs, one per row bucket) or ``"auto"``.
    buckets : row counts a run is padded to; the largest bounds the rows of one run.
    max_sequences : sequences alive at once; sizes the default block pool.
    num_cache_blocks : pool size (default: enough for ``max_sequences`` at the largest bucket).
    """

    def __init__(
        self,
        config: V4Config,
        tensors,
        *,
        device=None,
        mode: str = "streams",
        executor: str = "auto",
        buckets: Sequence[int] = DEFAULT_ROW_BUCKETS,
        max_sequences: int = 8,
        max_seq_len: int | None = None,
        num_cache_blocks: int | None = None,
        debug: bool = False,
    ) -> None:
        if mode not in ("streams", "collapsed"):
            raise InputError(describe("target mode", "'streams' or 'collapsed'", repr(mode)))
        if executor not in ("eager", "captured", "auto"):
            raise InputError(describe("target executor", "'eager', 'captured' or 'auto'", repr(executor)))
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise InputError(describe("target buckets", "ints >= 1", list(buckets)))
        self.config, self.mode, self.debug = config, mode, debug
        self.device = concrete_device(device if device is not None else "cpu")
        self.id = next(_ids)
        self.buckets = tuple(sorted(set(buckets)))
        self.max_seq_len = max_seq_len or config.max_position_embeddings
        block_size = 16
        per_seq = math.ceil((config.sliding_window + self.buckets[-1]) / block_size) + 2
        blocks = num_cache_blocks or max_sequences * per_seq
        self.cache = PagedLatentCache(config, blocks, max_seq_len=self.max_seq_len, device=self.device)
        self.geometry = CacheGeometry(
            self.cache.kv.shape[0], self.cache.max_blocks_per_seq, self.cache.block_size
        )
        # Note "one pool, L layers": layer 0 uses the pool's own tensor, the others twins of it.
        self.layer_kv = [self.cache.kv] + [
            torch.zeros_like(self.cache.kv) for _ in range(config.num_hidden_layers - 1)
        ]
        self.state_tensors = {layer_cache_name(i): kv for i, kv in enumerate(self.layer_kv)}
        weights = dict(tensors)
        for i in range(config.num_hidden_layers):
            weights = prepare_weights(config, weights, self.device, prefix=f"layers.{i}.")
        self.weights = weights
        self.graph = build_target(config, self.geometry, mode)
        self.use_captured = executor == "captured" or (executor == "auto" and self.device.type == "cuda")
        self._executors: dict[int, object] = {}
        self._kernel = batch_kernel.load()  # design note "flat kernel" (native/batch_kernel.py): the staging writes
        self._staging: dict[int, ChainStaging] = {}
        self._pool = None
        self._verifiers: dict[int, object] = {}  # K -> DeviceVerifier
        self.tracer = None  # draftgraph.tools.trace.Tracer: per-op slices plus one slice per run
        self.last_forward_seconds = 0.0

    @staticmethod
    def from_checkpoint(path: str | Path, device=None, **kw) -> TargetModel:
        """Load the target's tensors (``names="target"``) of a checkpoint folder."""
        from draftgraph.runtime.model.weights import load_checkpoint

        if device is not None:
            device = concrete_device(device)  # a device it cannot run on: refused before the read
        ckpt = load_checkpoint(path, names="target", device="cpu")
        return TargetModel(ckpt.config, ckpt.tensors, device=device, **kw)

    # ---- state -----------------------------------------------------------------------------------
    def alloc_state(self, budget_tokens: int | None = None) -> TargetSeqState:
        """A fresh sequence; ``budget_tokens`` bounds its positions (None: max_seq_len)."""
        if budget_tokens is not None and (not isinstance(budget_tokens, int) or budget_tokens < 1):
            raise InputError(describe("budget_tokens", "an int >= 1 or None", repr(budget_tokens)))
        limit = self.max_seq_len if budget_tokens is None else min(budget_tokens, self.max_seq_len)
        return TargetSeqState(table=self.cache.new_table(), max_positions=limit, owner=self.id)

    def free(self, state: TargetSeqState) -> None:
        """Return every block the sequence holds; the state cannot be used again."""
        self._check_state(state)
        self.cache.free(state.table)
        state.length = 0
        state.is_freed = True

    def truncate(self, state: TargetSeqState, length: int) -> None:
        """Roll back to ``length`` rows (drop rejected drafts) and recycle blocks outside the window."""
        self._check_state(state)
        if not isinstance(length, int) or not 0 <= length <= state.length:
            raise InputError(describe("truncate length", f"an int in [0, {state.length}]", repr(length)))
        self.cache.truncate(state.table, length)
        state.length = length
        self.cache.trim_window(state.table, length)

    # ---- forward -----------------------------------------------------------------------------
    def prefill(self, state: TargetSeqState, tokens: Sequence[int]) -> TargetOutput:
        """Run a prompt from position ``state.length`` (0 for a new sequence); rows are final."""
        return self.forward([state], [tokens], [self._check_state(state).length], final=True)[0]

    def verify(
        self,
        states: Sequence[TargetSeqState],
        token_lists: Sequence[Sequence[int]],
        start_positions: Sequence[int],
    ) -> list[TargetOutput]:
        """Score every sequence's window (last token + K drafts) in ONE graph run (when it fits a bucket).

        The rows stay in the cache until :meth:`truncate` rolls back to the accepted length.
        """
        return self.forward(states, token_lists, start_positions, final=False)

    def forward(
        self,
        states: Sequence[TargetSeqState],
        token_lists: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        *,
        final: bool = False,
    ) -> list[TargetOutput]:
        """Append ``token_lists[i]`` to sequence i at ``start_positions[i]`` (== its length).

        All rows of all sequences go into as few runs as the largest bucket allows (one, normally).
        ``final`` marks rows that will never be rolled back (a prompt): blocks leaving the window
        are then recycled between runs, so a long prompt needs only a window's worth of blocks.
        On any error the sequences keep their committed rows only (blocks past them go back).
        """
        for what, value in (("states", states), ("token_lists", token_lists), ("start_positions", start_positions)):
            if isinstance(value, TargetSeqState) or sequence_length(value) is None:
                raise InputError(describe(f"forward {what}", "a sequence with one entry per sequence",
                                          type(value).__name__, "prefill(state, tokens) takes one sequence"))
        n = len(states)
        if len(token_lists) != n or len(start_positions) != n:
            raise InputError(
                describe(
                    "forward batch",
                    f"{n} token lists and start positions",
                    f"{len(token_lists)} and {len(start_positions)}",
                    "one per sequence",
                )
            )
        if len({id(s) for s in states}) != n:
            raise InputError(describe("states", "distinct states", "the same state twice"))
        rows: list[tuple[int, int, int]] = []  # (sequence, position, token), sequence-major
        for i, (state, tokens, start) in enumerate(zip(states, token_lists, start_positions)):
            self._check_state(state)
            if sequence_length(tokens) is None:
                raise InputError(describe(f"sequence {i} tokens", "a sequence of token ids", type(tokens).__name__))
            tokens = [self._check_token(t, i) for t in tokens]
            if not tokens:
                raise InputError(describe(f"sequence {i} tokens", "at least one token", "none"))
            if start != state.length:
                raise InputError(
                    describe(
                        f"sequence {i} start position",
                        f"its length {state.length}",
                        start,
                        "rows are appended; truncate() to roll back first",
                    )
                )
            if start + len(tokens) > state.max_positions:
                raise InputError(
                    describe(
                        f"sequence {i} positions",
                        f"< {state.max_positions} (its budget)",
                        f"{start}..{start + len(tokens) - 1}",
                    )
                )
            rows += [(i, start + j, t) for j, t in enumerate(tokens)]
        started = time.perf_counter()
        parts: list[list[tuple]] = [[] for _ in range(n)]
        lengths = [s.length for s in states]
        chunk = self.buckets[-1]
        try:
            for at in range(0, len(rows), chunk):
                self._run_rows(states, rows[at : at + chunk], parts, final)
        except BaseException:
            for state, length in zip(states, lengths):
                if not final:  # provisional rows: all of this call's go
                    state.length = length
                self.cache.truncate(state.table, state.length)  # blocks past the kept rows go back
            raise
        self.last_forward_seconds = time.perf_counter() - started
        outputs = []
        for part in parts:
            if len(part) == 1:  # the usual forward: one run, the sequence's rows a view of its copy
                logits, hiddens, tokens = part[0]
                outputs.append(TargetOutput(logits, hiddens, tokens))
                continue
            logits, hiddens, tokens = zip(*part)
            outputs.append(
                TargetOutput(torch.cat(logits), torch.cat(hiddens), [t for ts in tokens for t in ts])
            )
        return outputs

    def _run_rows(self, states, rows, parts, final: bool) -> None:
        """One graph run over ``rows`` (<= the largest bucket), then commit each sequence's length."""
        m = len(rows)
        bucket = self._bucket(m)
        segments: dict[int, tuple[int, int]] = {}  # sequence -> (first, last) position in this run
        for i, pos, _ in rows:
            first, _last = segments.get(i, (pos, pos))
            segments[i] = (first, pos)
        self.cache.ensure_batch([states[i].table for i in segments], [f for f, _ in segments.values()],
                                [last for _, last in segments.values()])  # all or nothing
        staging = self._staging_for(bucket)
        tables = self.cache.table_rows([state.table for state in states])  # [S, max_blocks]: every table is fit now
        which, pos, tokens = (np.array(column, dtype=np.int64) for column in zip(*rows))
        staged = staging.stage(tables, which, pos, np.zeros_like(pos), tokens, [], 1)
        inputs = {name: staged[name] for name in self.graph.inputs}
        executor = self._executor(bucket)
        start = time.perf_counter_ns()
        out = executor.run(inputs, check=False)
        next_tokens = out["next_token"][:m].cpu().tolist()  # the run's one device-to-host read
        if self.tracer is not None:
            self.tracer.slice(
                f"target forward R={m} B={bucket}",
                start,
                time.perf_counter_ns() - start,
                cat="target",
                args={"rows": m, "bucket": bucket},
            )
        # The outputs are views of the arena, which the next run rewrites: one copy of the run's rows
        # each, and a view of it per sequence (not a copy per sequence: two launches, not 2 x S).
        logits, hidden = out["logits"][:m].clone(), out["hidden"][:m].clone()
        at = 0
        for i, (first, last) in segments.items():  # segments keep row order: sequence-major
            count = last - first + 1
            parts[i].append((logits[at : at + count], hidden[at : at + count], next_tokens[at : at + count]))
            states[i].length = last + 1
            if final:
                self.cache.trim_window(states[i].table, last + 1)
            at += count

    # ---- executors -----------------------------------------------------------------------------
    def _bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise InputError(describe("rows of one run", f"<= {self.buckets[-1]} (largest bucket)", rows))

    def _staging_for(self, bucket: int) -> ChainStaging:
        if bucket not in self._staging:
            self._staging[bucket] = ChainStaging(
                bucket, TensorSpec((B, 1), torch.bfloat16), self.cache.max_blocks_per_seq, 1, self.device,
                window=self.config.sliding_window, block_size=self.cache.block_size,
                kernel=self._kernel,  # the compiled twin where it builds: every verify and token stages
            )
        return self._staging[bucket]

    def graph_pool(self):
        """The one CUDA graph memory pool every capture of this target shares."""
        if self.device.type != "cuda":
            raise InputError(describe("graph_pool", "a target on a CUDA device (a pool of CUDA graphs)", self.device))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _executor(self, bucket: int):
        if bucket not in self._executors:
            if self.use_captured:
                from draftgraph.runtime.execution.captured import CapturedExecutor

                staged = self._staging_for(bucket).graph_inputs()
                self._executors[bucket] = CapturedExecutor(
                    self.graph,
                    bucket,
                    self.weights,
                    self.state_tensors,
                    device=self.device,
                    static_inputs={n: staged[n] for n in self.graph.inputs},
                    pool=self.graph_pool(),
                )
            else:
                self._executors[bucket] = EagerExecutor(
                    self.graph, bucket, self.weights, self.state_tensors, device=self.device, debug=self.debug
                )
        executor = self._executors[bucket]
        executor.tracer = self.tracer
        return executor

    def mark_dead(self, bucket: int):
        """Stage a run of no rows on the bucket's buffers (every row dead: it writes no cache row)."""
        (bucket,) = known_buckets("mark_dead bucket", [bucket], self.buckets, "target")
        empty = np.zeros(0, dtype=np.int64)
        no_table = np.full((1, self.cache.max_blocks_per_seq), -1, dtype=np.int32)
        return self._staging_for(bucket).stage(no_table, empty, empty, empty, empty, [], 1)

    def warm_up(self, buckets: Sequence[int]) -> None:
        """Build every bucket's executor and run it once on dead rows (captured: capture it), so that
        no run of these buckets builds, captures or compiles anything later. Unknown buckets: InputError."""
        for bucket in known_buckets("warm-up buckets", buckets, self.buckets, "target"):
            staged = self.mark_dead(bucket)
            self._executor(bucket).warm({name: staged[name] for name in self.graph.inputs})

    def device_verifier(self, num_drafts: int):
        """The :class:`~draftgraph.runtime.decode.device_verify.DeviceVerifier` for K drafts (one per K, kept)."""
        from draftgraph.runtime.decode.device_verify import DeviceVerifier

        verifier = self._verifiers.get(num_drafts) if type(num_drafts) is int else None
        if verifier is None:  # DeviceVerifier checks K: nothing is kept for a bad one
            verifier = self._verifiers[num_drafts] = DeviceVerifier(self, num_drafts)
        return verifier

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Build (and on CUDA capture) the executor of every bucket (None: all), largest first."""
        for bucket in known_buckets("capture buckets", self.buckets if buckets is None else buckets, self.buckets,
                                    "target"):
            executor = self._executor(bucket)
            if hasattr(executor, "capture") and executor.cuda_graph is None:
                executor.capture()

    # ---- checks --------------------------------------------------------------------------------
    def _check_state(self, state) -> TargetSeqState:
        if not isinstance(state, TargetSeqState):
            raise InputError(
                describe("target state", "a TargetSeqState from alloc_state()", type(state).__name__)
            )
        if state.owner != self.id:
            raise InputError(describe("target state", "a state of this model", "a state of another model"))
        if state.is_freed:
            raise InputError(
                describe("target state", "a live state", "a freed state", "alloc_state() a new one")
            )
        return state

    def _check_token(self, token, i: int) -> int:
        if isinstance(token, torch.Tensor) and token.numel() == 1:
            token = int(token.item())
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.config.vocab_size:
            raise InputError(
                describe(f"sequence {i} token", f"an int id in [0, {self.config.vocab_size})", repr(token))
            )
        return token

    def __repr__(self) -> str:
        return (
            f"TargetModel({self.config.num_hidden_layers} layers, {self.mode}, "
            f"{'captured' if self.use_captured else 'eager'}, buckets {self.buckets}, {self.cache!r})"
        )
