"""clamp_drafts and accept_drafts (ops/acceptance.py), one kernel each.

Why: the torch ops of a device verify's two ends are about twenty launches (the compare, the
cumulative product, the sums and the verdict's column copies, the pair copies, the finiteness
GEMV and its compares), each a node of the captured verify graph. Here the draft columns are one
kernel and the acceptance one program per sequence: the K + 1 drafts and argmax tokens in
registers, the first mismatch by a min, then the W + 1 pair rows copied (next_hidden's, then the
verify's) and tested for a NaN or an infinity as they pass (``|x| <= FLT_MAX`` is false for both),
only the rows the catch-up reads (0 .. a) counting. A sequence's rows are a few KB at the tiny
model's shapes (32 KB each at V4-Flash's [4, 4096] bf16): one program streams them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from draftgraph.ops.acceptance import accept_drafts as accept_reference
from draftgraph.ops.acceptance import clamp_drafts as clamp_reference
from draftgraph.ops.triton._common import next_pow2, pdl_args, pdl_wait

ROW_BLOCK = 2048  # hidden values a program copies a step (four 16-byte bf16 loads a thread at 4 warps)
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _clamp_drafts_kernel(drafts, tokens, top, S, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    i = tl.arange(0, BLOCK)
    inside = i < S * K
    d = tl.load(drafts + i, mask=inside, other=0)
    d = tl.minimum(tl.maximum(d, 0), top)
    tl.store(tokens + (i // K) * (K + 1) + 1 + i % K, d, mask=inside)


@triton.jit
def _accept_drafts_kernel(drafts, tokens, hidden, next_hidden, pair, verdict, N,
                          K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):  # fmt: skip
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = K + 1
    j = tl.arange(0, BLOCK_K)
    d = tl.load(drafts + s * K + j, mask=j < K, other=0)
    g = tl.load(tokens + s * W + j, mask=j < W, other=0)
    accepted = tl.min(tl.where((d != g) & (j < K), j, K), axis=0)  # the first mismatch, K when none
    dropped = tl.max(((d < 0) & (j < K)).to(tl.int32), axis=0)
    row = verdict + s * (3 + W)
    tl.store(row + 3 + j, g, mask=j < W)
    offs = tl.arange(0, BLOCK)
    out = pair + s * (W + 1) * N
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):  # pair row 0: h_p, which the catch-up always reads
        at = start + offs
        x = tl.load(next_hidden + s * N + at, mask=at < N, other=0.0)
        tl.store(out + at, x, mask=at < N)
        bad = bad | (~(tl.abs(x.to(tl.float32)) <= FLT_MAX)).to(tl.int32)
    for r in range(0, W):  # pair row 1 + r: the verify's row r, read by the catch-up when r < a
        read = (r < accepted).to(tl.int32)
        for start in range(0, N, BLOCK):
            at = start + offs
            x = tl.load(hidden + (s * W + r) * N + at, mask=at < N, other=0.0)
            tl.store(out + (1 + r) * N + at, x, mask=at < N)
            bad = bad | ((~(tl.abs(x.to(tl.float32)) <= FLT_MAX)).to(tl.int32) & read)
    tl.store(row, accepted.to(tl.int64))
    tl.store(row + 1, dropped.to(tl.int64))
    tl.store(row + 2, (tl.max(bad, axis=0) != 0).to(tl.int64))


def clamp_drafts(drafts, tokens, top: int) -> None:
    s, k = drafts.shape
    if not (drafts.is_contiguous() and tokens.is_contiguous()):
        clamp_reference(drafts, tokens, top)
        return
    _clamp_drafts_kernel[(1,)](drafts, tokens, top, s, K=k, BLOCK=max(16, next_pow2(s * k)), num_warps=1,
                               **pdl_args(drafts.device))  # fmt: skip


def accept_drafts(drafts, tokens, hidden, next_hidden, pair, verdict) -> None:
    s, k = drafts.shape
    n = next_hidden[0].numel() if s else 0
    if not all(t.is_contiguous() for t in (drafts, tokens, hidden, next_hidden, pair, verdict)) \
            or hidden.dtype != pair.dtype or next_hidden.dtype != pair.dtype:  # fmt: skip
        accept_reference(drafts, tokens, hidden, next_hidden, pair, verdict)
        return
    _accept_drafts_kernel[(s,)](drafts, tokens, hidden, next_hidden, pair, verdict, n, K=k,
                                BLOCK_K=max(2, next_pow2(k + 1)), BLOCK=min(ROW_BLOCK, max(128, next_pow2(n))),
                                num_warps=4, **pdl_args(drafts.device))  # fmt: skip


__all__ = ["accept_drafts", "clamp_drafts"]
