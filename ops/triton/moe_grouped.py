"""moe at batch > 1: each chosen expert read once, for every row that chose it.

The slot-major kernels of ``moe.py`` give every (row, k) slot its own pass over its
expert, so at batch 32 an expert chosen by five rows is streamed five times (9.6 GB of
reads for the ~1.2 GB the batch touches). Here the same grid, (blocks, B*K + 1 slots),
is expert-major: a slot works only when it is the *owner* of its expert (the lowest slot
that chose it); it multiplies the expert's weight tile by all rows that chose it at once
(one ``tl.dot`` over the padded batch) and the other slots of that expert do nothing.
The last slot is the shared expert for every row (when the op has one: ``has_shared``).

A negative expert id (``moe.NO_EXPERT``: the route writes it for moe_shard's pairs of another
rank's experts) owns nothing: its slot reads no weight bytes and serves no row, and the reduce
skips it (a row with none of its experts here gets 0, or the shared expert alone).

Three launches after gate and route (``moe.plan``):
1. w13: act[b, k] = w * silu(min(g, limit)) * clamp(u) for each row b that chose the
   owner's expert at its top-k position k (the first one, should a row list an expert
   twice: the weights of the repeats are summed into it).
2. w2: part[b, k] = act[b, k] @ w2[e]^T in fp32, same owners and rows.
3. reduce, grid (B, D blocks): out[b] = sum over the row's first-occurrence k of
   part[b, k] + part[shared, b], in k order: deterministic, no atomics.

Note "aligned rows": the weight rows are picked at run time (the shared expert's matrix or the
slot's expert), and Triton 3.9 loses their 16-byte alignment across that select: compiled for
sm_90 it read the bf16 tiles an element a load (128 ``LDG.E.U16`` + ``STS.U16`` a thread in w13)
where 3.6 uses cp.async, 16 bytes a copy. Where the host has checked the alignment (``ALIGNED``:
every weight's data 16-byte aligned, rows of a multiple of 8 elements), the tile pointers carry it
as ``tl.multiple_of`` / ``tl.max_contiguous`` hints, as fp8_linear's note "aligned rows" does.
"""

from __future__ import annotations

import triton
import triton.language as tl
from draftgraph.ops.triton._common import (
    clamped_swiglu,
    mma,
    next_pow2,
    pdl_args,
    pdl_wait,
    rows_aligned,
    tile_pointers,
)

REDUCE_BLOCK_D = 1024


@triton.jit
def expert_hits(idx_ptr, e, B, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """The routing's pairs that chose expert ``e``: (rows [BLOCK_B], ks [TOPK_PAD], the pairs' flat
    slots [BLOCK_B, TOPK_PAD], hit [BLOCK_B, TOPK_PAD]: the pair is real and chose e)."""
    rows = tl.arange(0, BLOCK_B)
    ks = tl.arange(0, TOPK_PAD)
    flat = rows[:, None] * TOPK + ks[None, :]
    in_range = (rows < B)[:, None] & (ks < TOPK)[None, :]
    ids = tl.load(idx_ptr + flat, mask=in_range, other=-1).to(tl.int64)
    return rows, ks, flat, in_range & (ids == e)


@triton.jit
def _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """What ``slot`` computes: (expert, shared?, owner?, rows [BLOCK_B] it serves, their weights,
    their destination act / part rows)."""
    routed = B * TOPK
    shared = slot >= routed
    e = tl.load(idx_ptr + tl.minimum(slot, routed - 1)).to(tl.int64)
    rows, ks, flat, hit = expert_hits(idx_ptr, e, B, TOPK, TOPK_PAD, BLOCK_B)
    first_slot = tl.min(tl.min(tl.where(hit, flat, routed), 1), 0)
    owner = shared | ((first_slot == slot) & (e >= 0))  # a negative id (NO_EXPERT) owns nothing
    chose = tl.sum(hit.to(tl.int32), 1) > 0
    serves = tl.where(shared, rows < B, chose) & ((rows * 0 + owner.to(tl.int32)) != 0)
    k_first = tl.min(tl.where(hit, ks[None, :], TOPK_PAD), 1)
    wts = tl.load(wts_ptr + flat, mask=hit, other=0.0)
    weight = tl.where(shared, 1.0, tl.sum(wts, 1))
    dest = tl.where(shared, routed + rows, rows * TOPK + k_first)
    return e, shared, owner, serves, weight, dest


@triton.jit
def _moe_w13_grouped_kernel(
    x_ptr,
    idx_ptr,
    wts_ptr,
    w1_ptr,
    w3_ptr,
    sw1_ptr,
    sw3_ptr,
    act_ptr,
    B,
    D,
    INTER,
    stride_xb,
    limit,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ALIGNED: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    e, shared, owner, serves, weight, dest = _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_B)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < INTER
    rows = tl.arange(0, BLOCK_B)
    row_off = offs_n.to(tl.int64)[:, None] * D
    w1_rows = tl.where(shared, sw1_ptr + row_off, w1_ptr + e * INTER * D + row_off)
    w3_rows = tl.where(shared, sw3_ptr + row_off, w3_ptr + e * INTER * D + row_off)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xb
    acc1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    k_end = tl.where(owner, D, 0)  # a slot that does not own its expert reads nothing
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < D
        w_mask = n_mask[:, None] & k_mask[None, :]
        a1 = tl.load(tile_pointers(w1_rows, kk, ALIGNED), mask=w_mask, other=0.0)
        a3 = tl.load(tile_pointers(w3_rows, kk, ALIGNED), mask=w_mask, other=0.0)
        xv = tl.load(x_rows + kk[None, :], mask=(rows < B)[:, None] & k_mask[None, :], other=0.0)
        xt = tl.trans(xv.to(a1.dtype))
        acc1 += mma(a1, xt, INTERP)
        acc3 += mma(a3, xt, INTERP)
    act = clamped_swiglu(acc1, acc3, limit) * weight[None, :]
    ptrs = act_ptr + dest.to(tl.int64)[None, :] * INTER + offs_n[:, None]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=n_mask[:, None] & serves[None, :])


@triton.jit
def _moe_w2_grouped_kernel(
    act_ptr,
    idx_ptr,
    wts_ptr,
    w2_ptr,
    sw2_ptr,
    part_ptr,
    B,
    D,
    INTER,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ALIGNED: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    e, shared, owner, serves, _, dest = _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_B)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < D
    row_off = offs_n.to(tl.int64)[:, None] * INTER
    w_rows = tl.where(shared, sw2_ptr + row_off, w2_ptr + e * D * INTER + row_off)
    a_rows = act_ptr + dest.to(tl.int64)[:, None] * INTER
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    k_end = tl.where(owner, INTER, 0)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < INTER
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(tile_pointers(w_rows, kk, ALIGNED), mask=w_mask, other=0.0)
        a = tl.load(a_rows + kk[None, :], mask=serves[:, None] & k_mask[None, :], other=0.0)
        acc += mma(w, tl.trans(a.to(w.dtype)), INTERP)
    ptrs = part_ptr + dest.to(tl.int64)[None, :] * D + offs_n[:, None]
    tl.store(ptrs, acc, mask=n_mask[:, None] & serves[None, :])


@triton.jit
def _moe_reduce_kernel(
    part_ptr,
    idx_ptr,
    out_ptr,
    B,
    D,
    stride_ob,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[b] (+)= the row's first-occurrence partials in k order, + the shared one (also moe_mxfp4's reduce)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    ks = tl.arange(0, TOPK_PAD)
    k_mask = ks < TOPK
    ids = tl.load(idx_ptr + b * TOPK + ks, mask=k_mask, other=-1)
    earlier_same = (ids[:, None] == ids[None, :]) & (ks[None, :] < ks[:, None])  # [k, j]: j < k, same expert
    first = k_mask & (ids >= 0) & (tl.sum(earlier_same.to(tl.int32), 1) == 0)
    rows = (b * TOPK + ks).to(tl.int64)
    parts = tl.load(part_ptr + rows[:, None] * D + offs_d[None, :], mask=first[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(parts, 0)
    if HAS_SHARED:
        total += tl.load(part_ptr + (B * TOPK + b).to(tl.int64) * D + offs_d, mask=d_mask, other=0.0)
    ptrs = out_ptr + b.to(tl.int64) * stride_ob + offs_d
    if ACCUMULATE:
        total += tl.load(ptrs, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=d_mask)


def launches(
    x, idx, wts, w1, w3, w2, sw1, sw3, sw2, act, part, out, top_k, limit, c13, c2, block_b, interp, has_shared=True
):
    """The three batched launches after gate and route, as (name, thunk); ``has_shared`` False: no
    shared slot (sw1 / sw3 / sw2 are then never read: pass any bf16 tensors)."""
    b, d = x.shape
    inter = w1.shape[1]
    slots = b * top_k + (1 if has_shared else 0)
    topk_pad = next_pow2(top_k)
    pdl = pdl_args(x.device)
    aligned = rows_aligned(w1, w3, w2, sw1, sw3, sw2)  # note "aligned rows"

    def w13():
        bn = max(16, min(c13.block_n, next_pow2(inter)))
        bk = min(c13.block_k, max(16, next_pow2(d)))
        _moe_w13_grouped_kernel[(triton.cdiv(inter, bn), slots)](
            x, idx, wts, w1, w3, sw1, sw3, act, b, d, inter, x.stride(0), float(limit),
            TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_N=bn, BLOCK_K=bk, BLOCK_B=block_b, ALIGNED=aligned,
            INTERP=interp, num_warps=c13.num_warps, num_stages=c13.num_stages, **pdl,
        )  # fmt: skip

    def w2_():
        bn = max(16, min(c2.block_n, next_pow2(d)))
        bk = min(c2.block_k, max(16, next_pow2(inter)))
        _moe_w2_grouped_kernel[(triton.cdiv(d, bn), slots)](
            act, idx, wts, w2, sw2, part, b, d, inter,
            TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_N=bn, BLOCK_K=bk, BLOCK_B=block_b, ALIGNED=aligned,
            INTERP=interp, num_warps=c2.num_warps, num_stages=c2.num_stages, **pdl,
        )  # fmt: skip

    def reduce():
        block_d = min(REDUCE_BLOCK_D, next_pow2(d))
        _moe_reduce_kernel[(b, triton.cdiv(d, block_d))](
            part, idx, out, b, d, out.stride(0),
            TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_D=block_d, HAS_SHARED=has_shared, ACCUMULATE=False,
            num_warps=4, **pdl,
        )  # fmt: skip

    return [("w13", w13), ("w2", w2_), ("reduce", reduce)]
