"""ProposerOptions: what a DeepseekV4MtpProposer is built with, checked once at construction."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.execution.kernel_choice import check_kernels

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
EXECUTORS = ("auto", "eager", "captured")
WEIGHTS = ("native", "bf16")
ACTIVATIONS = ("bf16", "fp8")
HEAD_DTYPES = ("bf16", "fp8")
EXTRA_KEYS = frozenset({"vocab_limit"})  # set_vocab_limit's value
_W8A8_NEEDS_NATIVE = describe("activations", "'bf16' with bf16 weights", "'fp8'",
                              "W8A8 quantises the inputs of FP8 / MXFP4 linears: pass weights='native'")


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
    # How the checkpoint's FP8 / MXFP4 weights are held (graphs/v4_block.py, design note "numerics"):
    # "native" keeps them as stored (data + UE8M0 scales, no bf16 copy), "bf16" dequantises at load.
    # None: "native" on CUDA, "bf16" on CPU. A bf16 checkpoint stays bf16 either way.
    weights: str | None = None
    # Round the non-rotary part of each cached KV row through FP8 e4m3 (blocks of 64, power-of-two
    # scales), as DeepSeek's reference does. None: on with native FP8 / MXFP4 weights, else off (bf16 numerics).
    kv_fp8_round: bool | None = None
    # "fp8": W8A8, the input of every FP8 / MXFP4 linear rounded through FP8 per 1x128 run, as the
    # reference and vLLM's block-FP8 path. "bf16": bf16 activations, the default (benchmarks/README.md,
    # "Weights and numerics": W8A8 was slower at B = 1 / 8 / 32 on an H100, and it moves drafts away from
    # the unrounded step).
    activations: str = "bf16"
    # "fp8": the LM head's rows quantised at load to FP8 e4m3 with 128x128 UE8M0 scales, for drafting
    # only (half the head's bytes: the V4-Flash B=1 floor 1.31 -> 0.78 GB; benchmarks/README.md, "FP8 draft head").
    # The embedding keeps its own bf16 tensor. "bf16": the checkpoint's head, the default.
    head_dtype: str = "bf16"
    # Several ranks (runtime/proposer/sharding.py, docs/SHARDING.md): a torch.distributed process group,
    # or "env" (torchrun's variables). World > 1: experts expert-parallel, the head vocab-parallel,
    # needs_comm() True. None (or a group of one rank): one rank, today's graphs.
    process_group: object | None = None
    extra: dict = field(default_factory=dict)

    def weights_on(self, device) -> str:
        """The weights option resolved for ``device``: "native" on CUDA, "bf16" elsewhere, unless set."""
        if self.weights is not None:
            return self.weights
        return "native" if torch.device(device).type == "cuda" else "bf16"

    def kv_fp8_round_on(self, device, has_block_scaled: bool = True) -> bool:
        """kv_fp8_round resolved: on with native weights that keep a block-scaled format, else off, unless set.

        A bf16 checkpoint held "native" is bf16: it keeps today's bf16 numerics.
        """
        if self.kv_fp8_round is not None:
            return bool(self.kv_fp8_round)
        return self.weights_on(device) == "native" and has_block_scaled

    def check(self, vocab_size: int, block_size: int, max_positions: int | None = None) -> None:
        """Raise InputError for an option the proposer cannot run with (``max_positions``: the
        model's max_position_embeddings, the largest max_seq_len)."""
        for name in ("overlap", "debug", "poison_arena"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(describe(name, "True or False", repr(getattr(self, name))))
        top = max_positions if max_positions is not None else 1 << 62
        if self.max_seq_len is not None and not _int_in(self.max_seq_len, 1, top):
            raise InputError(describe("max_seq_len", f"None or an int in [1, {top}] (the model's positions)",
                                      repr(self.max_seq_len), "None: the model's max_position_embeddings"))
        if self.num_cache_blocks is not None and not _int_in(self.num_cache_blocks, 1, 1 << 62):
            raise InputError(describe("num_cache_blocks", "None or an int >= 1", repr(self.num_cache_blocks),
                                      "None: enough for the largest bucket's windows"))
        if not isinstance(self.extra, dict) or set(self.extra) - EXTRA_KEYS:
            got = repr(self.extra) if not isinstance(self.extra, dict) else sorted(set(self.extra) - EXTRA_KEYS)
            raise InputError(describe("extra", f"a dict with keys among {sorted(EXTRA_KEYS)}", got))
        if "vocab_limit" in self.extra and not _int_in(self.extra["vocab_limit"], 1, vocab_size):
            raise InputError(describe("extra['vocab_limit']", f"an int in [1, {vocab_size}]",
                                      repr(self.extra["vocab_limit"]), "or call set_vocab_limit() after building"))
        if self.mode not in ("streams", "collapsed"):
            raise InputError(describe("mode", "'streams' or 'collapsed'", repr(self.mode)))
        check_kernels(self.kernels)
        if self.weights is not None and self.weights not in WEIGHTS:
            raise InputError(describe("weights", " or ".join(map(repr, WEIGHTS)) + " (or None: by device)",
                                      repr(self.weights), "'native' keeps FP8 / MXFP4 as stored, 'bf16' dequantises"))
        if self.kv_fp8_round is not None and not isinstance(self.kv_fp8_round, bool):
            raise InputError(describe("kv_fp8_round", "True, False or None (on with native weights)",
                                      repr(self.kv_fp8_round)))
        if self.activations not in ACTIVATIONS:
            raise InputError(describe("activations", " or ".join(map(repr, ACTIVATIONS)), repr(self.activations)))
        if self.activations == "fp8" and self.weights == "bf16":
            raise InputError(_W8A8_NEEDS_NATIVE)
        if self.head_dtype not in HEAD_DTYPES:
            raise InputError(describe("head_dtype", " or ".join(map(repr, HEAD_DTYPES)), repr(self.head_dtype),
                                      "'fp8' quantises the head rows at load for drafting (no MXFP4 head: "
                                      "no MXFP4 GEMV kernel)"))
        if self.executor not in EXECUTORS:
            raise InputError(describe("executor", " or ".join(map(repr, EXECUTORS)), repr(self.executor)))
        tau = self.draft_conf_tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
            raise InputError(describe("draft_conf_tau", "a number in [0, 1] (0: never stop early)",
                                      repr(self.draft_conf_tau)))
        if not _int_in(self.mtp_vocab_size, 0, vocab_size):
            raise InputError(describe("mtp_vocab_size", f"an int in [0, {vocab_size}] (0: the full vocab)",
                                      repr(self.mtp_vocab_size)))
        # A propose's K positions span at most two blocks: the host tests only their two ends.
        if not _int_in(self.max_num_drafts, 1, block_size):
            raise InputError(describe("max_num_drafts", f"an int in [1, {block_size}] (the cache's block size)",
                                      repr(self.max_num_drafts)))
        check_buckets(self.buckets)

    def check_on(self, device) -> None:
        """The checks that need the device (the weights option resolves by device)."""
        if self.activations == "fp8" and self.weights_on(device) == "bf16":
            raise InputError(_W8A8_NEEDS_NATIVE)


def check_buckets(buckets: object) -> tuple[int, ...]:
    """The batch buckets as a sorted tuple of distinct ints >= 1, from a sequence of at least one
    (numpy integers taken as ints, bools refused, as everywhere in the API)."""
    try:
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or any(
                isinstance(b, (bool, np.bool_)) for b in buckets):
            raise TypeError
        sizes = tuple(sorted({operator.index(b) for b in buckets}))
    except TypeError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise InputError(describe("buckets", "a sequence of ints >= 1 (batch sizes)", repr(buckets)))
    return sizes


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
