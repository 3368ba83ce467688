"""DeviceVerifier: the target's verify of K drafts that never leave the device, acceptance included.

Design note "one read per step": the host path reads the drafts back after the propose, builds
the verify rows [t, d_1..d_K] on the host, reads the target's argmax back, and accepts on the
host: two device-to-host reads and a sync between the two graphs. Here one verify run does it all
on the device, for every live sequence (S of them, each K + 1 rows, sequence-major):

    prologue   the draft columns of the verify input: token[s, 1..K] = clamp(drafts[s])
               (the host staged t at column 0 and the positions, tables, kv_start of every row)
    target     the target graph over the S x (K + 1) rows (its bucket's executor)
    epilogue   pair_hidden[s, 0] = next_hidden[s] (h_p, the hidden the propose read)
               g = next_token as [S, K + 1]; match = drafts == g[:, :K]
               a = sum(cumprod(match)): the longest matching prefix (gpt-fast's rule on the device)
               dropped = some draft < 0 (the chain marked a non-finite hidden: ops/nonfinite.py)
               pair_hidden[s, 1 + j] = row j's hidden, j = 0..K: [h_p, h_{p+1} ..] pairs the
               catch-up's tokens [t, d_1 ..]; the row of the bonus token's position is 1 + a
               bad = a NaN or an infinity in pair rows 0 .. a (what the catch-up reads)
               verdict[s] = [a, dropped, bad, g_0 .. g_K]                  # int64 [S, 3 + K + 1]

The prologue and the epilogue are ops/acceptance.py's ``clamp_drafts`` and ``accept_drafts``: on
CUDA one Triton kernel each (ops/triton/acceptance.py; the torch ops are some twenty launches,
each a node of the verify graph), else the torch ops, which the kernels are tested against.
Captured (CUDA), prologue, target and epilogue are one CUDA graph per row bucket, on the same
static staging buffers as the target's own graph of that bucket. The host then reads
``verdict[:S]`` once: emitted tokens are g_0 .. g_a (the accepted drafts equal g, the bonus is
g_a); the next propose reads its hiddens as rows of pair_hidden (pair row 1 + a, and its
catch-up's rows 0 .. a: decode/loop.py, design note "rows by index"), and the loop copies row
1 + a into next_hidden after that propose's launch. A run reads next_hidden and writes only other buffers,
so running it twice (a capture's warm-up runs) gives what running it once does. The buffers
are shared by every bucket's graph, so a batch that shrinks (a sequence ends) keeps its rows
where the next bucket's graph reads them.

Example
-------
>>> verifier = DeviceVerifier(target, num_drafts=3)                        # doctest: +SKIP
>>> verifier.run(states, [t0, t1], handle.drafts)                          # doctest: +SKIP
>>> verdict = verifier.verdict[:2].cpu()     # the step's one read-back     # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from draftgraph.ops import acceptance as acceptance_ops
from draftgraph.ops.acceptance import TOKENS
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.proposer.checks import known_buckets


class DeviceVerifier:
    """The verify graphs of one target for K drafts per sequence, and their static buffers.

    Parameters
    ----------
    target : the TargetModel (its buckets, staging, executors and cache).
    num_drafts : K. A run verifies at most ``max_sequences = largest bucket // (K + 1)`` sequences.
    """

    def __init__(self, target, num_drafts: int) -> None:
        if not isinstance(num_drafts, int) or isinstance(num_drafts, bool) or num_drafts < 1:
            raise InputError(describe("num_drafts", "an int >= 1", repr(num_drafts)))
        width = num_drafts + 1
        if target.buckets[-1] < width:
            raise InputError(describe("target's largest row bucket", f">= K + 1 = {width}", target.buckets[-1]))
        self.target, self.num_drafts, self.width = target, num_drafts, width
        self.max_sequences = target.buckets[-1] // width
        s, k, device = self.max_sequences, num_drafts, target.device
        hidden = target.graph.values["hidden"].spec
        row = tuple(hidden.shape[1:])
        self.draft_buf = torch.zeros(s, k, dtype=torch.int64, device=device)  # [S, K]: the proposer's drafts
        self.verdict = torch.zeros(s, TOKENS + width, dtype=torch.int64, device=device)  # [S, 3 + K + 1]
        self.next_hidden = torch.zeros(s, *row, dtype=hidden.dtype, device=device)  # [S, C, D] or [S, D]
        self.pair_hidden = torch.zeros(s, width + 1, *row, dtype=hidden.dtype, device=device)  # [S, K + 2, ...]
        self._ends = _verify_ends(device)
        self._executors: dict[int, object] = {}
        self.owner = None  # the DecodeSession whose rows next_hidden holds (decode/loop.py)
        self._last_bucket = target.buckets[-1]

    # ---- the run --------------------------------------------------------------------------------
    def bucket_for(self, num_sequences: int) -> int:
        return self.target._bucket(num_sequences * self.width)

    def run(self, states: Sequence, last_tokens: Sequence[int], drafts: torch.Tensor) -> None:
        """Append [t_i, d_i] for every sequence (at its length) and verify them in one graph run.

        ``drafts`` : int64 [S, K] on the target's device (a DeviceDrafts' view). Every input is
        checked before any work; on an error the sequences keep their committed rows only. The
        verdict, pair_hidden and next_hidden rows 0 .. S-1 hold the result; nothing is read back.
        """
        target, k, width = self.target, self.num_drafts, self.width
        n = len(states)
        if not 1 <= n <= self.max_sequences:
            raise InputError(describe("sequences of one device verify", f"1..{self.max_sequences}", n,
                                      "largest row bucket // (K + 1)"))
        if len(last_tokens) != n:
            raise InputError(describe("last_tokens", f"{n} (one per state)", len(last_tokens)))
        if len({id(s) for s in states}) != n:
            raise InputError(describe("states", "distinct states", "the same state twice"))
        if not isinstance(drafts, torch.Tensor) or tuple(drafts.shape) != (n, k) or drafts.dtype != torch.int64 \
                or drafts.device != target.device:
            raise InputError(describe("drafts", f"int64 [{n}, {k}] on {target.device}",
                                      f"{getattr(drafts, 'dtype', type(drafts).__name__)} "
                                      f"{list(getattr(drafts, 'shape', []))} on {getattr(drafts, 'device', '?')}"))
        for i, (state, token) in enumerate(zip(states, last_tokens)):
            target._check_state(state)
            target._check_token(token, i)
            if state.length + width > state.max_positions:
                raise InputError(describe(f"sequence {i} positions", f"< {state.max_positions} (its budget)",
                                          f"{state.length}..{state.length + width - 1}"))
        bucket = self.bucket_for(n)
        lengths = [s.length for s in states]
        try:
            target.cache.ensure_batch([state.table for state in states], lengths,
                                      [length + width - 1 for length in lengths])  # all or nothing
            tables = target.cache.table_rows([state.table for state in states])  # [S, max_blocks]
            which = np.repeat(np.arange(n, dtype=np.int64), width)
            pos = (np.asarray(lengths, dtype=np.int64)[:, None] + np.arange(width)).reshape(-1)
            tokens = np.zeros((n, width), dtype=np.int64)
            tokens[:, 0] = [int(t) for t in last_tokens]  # the draft columns come from the device
            staged = target._staging_for(bucket).stage(tables, which, pos, np.zeros_like(pos), tokens.reshape(-1),
                                                        [], 1)
            executor = self.executor(bucket)
            self._last_bucket = bucket
            tracer = getattr(executor, "executor", executor).tracer = target.tracer
            start = time.perf_counter_ns()
            self.draft_buf[:n].copy_(drafts)
            executor.run({name: staged[name] for name in target.graph.inputs}, check=False)
            if tracer is not None:
                tracer.slice(f"target verify on device R={n * width} B={bucket}", start,
                             time.perf_counter_ns() - start, cat="target", args={"rows": n * width, "bucket": bucket})
            for state, start in zip(states, lengths):
                state.length = start + width
        except BaseException:
            for state, length in zip(states, lengths):
                state.length = length
                target.cache.truncate(state.table, length)  # blocks past the kept rows go back
            raise

    def read_verdict(self, num_sequences: int) -> np.ndarray:
        """The verdict's first rows on the host (int64 [S, 3 + K + 1]): one copy and one wait.

        Through the staging buffer of the last run's bucket, whose read-back also marks its own
        staging copy done: the next verify's stage then need not wait for the device (it would
        wait for the chain the propose just launched).
        """
        return self.target._staging_for(self._last_bucket).read_rows(self.verdict, num_sequences).copy()

    # ---- executors ------------------------------------------------------------------------------
    def executor(self, bucket: int):
        """The verify run of a row bucket: built (and on CUDA captured) on first use; warm_up builds them all."""
        if bucket not in self._executors:
            slots = bucket // self.width
            prologue, epilogue = self._prologue(bucket, slots), self._epilogue(slots)
            target = self.target
            if target.use_captured:
                self._executors[bucket] = _captured_verify(target, bucket, prologue, epilogue)
            else:  # the target's own eager executor of the bucket, with the two ends around it
                self._executors[bucket] = _EagerVerify(target._executor(bucket), prologue, epilogue)
        return self._executors[bucket]

    def warm_up(self, buckets: Sequence[int]) -> None:
        """Build every bucket's verify run and run it once on dead rows (captured: capture it)."""
        target = self.target
        for bucket in known_buckets("verify warm-up buckets", buckets, target.buckets, "target"):
            staged = target.mark_dead(bucket)
            self.executor(bucket).warm({name: staged[name] for name in target.graph.inputs})

    def _prologue(self, bucket: int, slots: int):
        tokens = self.target._staging_for(bucket).views["token"]
        drafts, top, clamp = self.draft_buf[:slots], self.target.config.vocab_size - 1, self._ends.clamp_drafts

        def prologue() -> None:
            clamp(drafts, tokens, top)  # the draft columns; a dropped chain's NONFINITE marks stay valid ids

        return prologue

    def _epilogue(self, slots: int):
        drafts, verdict = self.draft_buf[:slots], self.verdict[:slots]
        h_p, pair, accept = self.next_hidden[:slots], self.pair_hidden[:slots], self._ends.accept_drafts

        def epilogue(outputs) -> None:
            accept(drafts, outputs["next_token"], outputs["hidden"], h_p, pair, verdict)

        return epilogue


def _verify_ends(device: torch.device):
    """clamp_drafts and accept_drafts: one kernel each on CUDA (ops/triton/acceptance.py), else the torch ops."""
    from draftgraph.ops import triton as fused

    if device.type == "cuda" and fused.available():
        from draftgraph.ops.triton import acceptance

        return acceptance
    return acceptance_ops


class _EagerVerify:
    """The target's eager executor of a bucket with the verify's prologue and epilogue around it."""

    def __init__(self, executor, prologue, epilogue) -> None:
        self.executor, self.prologue, self.epilogue = executor, prologue, epilogue

    def run(self, inputs, check: bool = False):
        self.prologue()
        outputs = self.executor.run(inputs, check=check)
        self.epilogue(outputs)
        return outputs

    def warm(self, inputs) -> None:
        self.run(inputs)


def _captured_verify(target, bucket: int, prologue, epilogue):
    """A CapturedExecutor of the target graph whose capture holds the prologue and the epilogue too."""
    from draftgraph.runtime.execution.captured import CapturedExecutor

    class CapturedVerify(CapturedExecutor):
        def _run_steps(self):
            outputs = super()._run_steps()  # the prologue, then the target's steps
            epilogue(outputs)
            return outputs

    staged = target._staging_for(bucket).graph_inputs()
    return CapturedVerify(target.graph, bucket, target.weights, target.state_tensors, device=target.device,
                          static_inputs={n: staged[n] for n in target.graph.inputs}, pool=target.graph_pool(),
                          prologue=prologue)
