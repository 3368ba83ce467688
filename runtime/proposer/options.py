"""ProposerOptions: what a DeepseekV4MtpProposer is built with, checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.execution.kernel_choice import check_kernels

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
EXECUTORS = ("auto", "eager", "captured")


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
    kernels: str = "auto"  # "auto" (fused on CUDA), "torch", "compiled" (runtime/execution/kernel_choice.py)
    overlap: bool = True  # on CUDA, ops may queue work that only later steps read on a side stream (ops.overlap)
    debug: bool = False
    poison_arena: bool = False  # fill the arena with NaN before every run (tests of invariant 3)
    extra: dict = field(default_factory=dict)

    def check(self, vocab_size: int, block_size: int) -> None:
        """Raise InputError for an option the proposer cannot run with."""
        if self.mode not in ("streams", "collapsed"):
            raise InputError(describe("mode", "'streams' or 'collapsed'", repr(self.mode)))
        check_kernels(self.kernels)
        if self.executor not in EXECUTORS:
            raise InputError(describe("executor", " or ".join(map(repr, EXECUTORS)), repr(self.executor)))
        if not 0.0 <= self.draft_conf_tau <= 1.0:
            raise InputError(describe("draft_conf_tau", "in [0, 1] (0: never stop early)", self.draft_conf_tau))
        if not isinstance(self.mtp_vocab_size, int) or not 0 <= self.mtp_vocab_size <= vocab_size:
            raise InputError(describe("mtp_vocab_size", f"an int in [0, {vocab_size}] (0: the full vocab)",
                                      repr(self.mtp_vocab_size)))
        # A propose's K positions span at most two blocks: the host tests only their two ends.
        if not isinstance(self.max_num_drafts, int) or not 1 <= self.max_num_drafts <= block_size:
            raise InputError(describe("max_num_drafts", f"an int in [1, {block_size}] (the cache's block size)",
                                      repr(self.max_num_drafts)))
        buckets = tuple(self.buckets)
        if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
            raise InputError(describe("buckets", "ints >= 1", list(buckets)))
