"""Expert-major MXFP4 MoE for small batches: each routed expert's words decoded once, FMA per row.

``moe_mxfp4``'s expert-major kernels (batch > 1) multiply by ``tl.dot``: the decoded tile goes
through shared memory into the MMA, on tiles of at most 128 columns (an FP8 tile lies in one
scale block). On an H200 (benchmarks/h200, 2026-12-05) they ran the batch-4 MoE at 12% of
copy bandwidth while the batch-1 FMA kernel, on wide word tiles ("MXFP4 words"), ran at 28%.
Here a routed expert's owner slot (``moe_grouped._owned_rows``: the first slot that chose it)
decodes each word once, as at batch 1, and multiplies it by the rows that chose the expert in
registers, CHUNK rows at a time ([BLOCK_N, scale blocks, 4 words, CHUNK] accumulators; the rows
ranked by a cumsum and picked by one-hot selectors, a short last chunk masked): the FMA work is
about 3.4 instructions a code to decode plus one a row, and a chunk re-reads the expert's tile
(from L2 after the first). The shared expert serves every row: its slot keeps the dot tiles.
The launcher takes this path up to ``moe_mxfp4.ROWS_MAX_BATCH`` rows: 0 (off) until a GPU has run
and timed it (docs/KERNELS.md, "Second device run").

Layouts, scratch and the deterministic reduce are ``moe_mxfp4``'s expert-major ones: w13 writes
each served row's act row, w2 fp32 partials per (row, k), ``_moe_reduce_kernel`` sums them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from draftgraph.ops.triton._common import clamped_swiglu, pdl_wait
from draftgraph.ops.triton.fp8_linear import ue8m0_to_f32
from draftgraph.ops.triton.moe_grouped import _owned_rows
from draftgraph.ops.triton.moe_mxfp4 import _expert_tiles, _hi, _lo, e2m1_word_pairs


@triton.jit
def _rows_fma(a_rows, a_mask, w_rows, s_rows, n_mask, K, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_R: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """W[rows] @ a^T over K (up to k_end: 0 reads nothing) -> fp32 [BLOCK_N, BLOCK_R].

    a_rows: [BLOCK_R] int32 pointers to the activation rows (bf16 pairs), a_mask: the rows read;
    w_rows: [BLOCK_N] int32 pointers to the weight rows' first word; s_rows: to their first scale.
    """
    NB: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, NB)
    p4 = tl.arange(0, 4)
    acc = tl.zeros([BLOCK_N, NB, 4, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kw = k0 // 8 + g[:, None] * 4 + tl.arange(0, 4)[None, :]  # [NB, 4] word columns
        live = kw < K // 8
        w = tl.load(w_rows[:, None, None] + kw[None, :, :], mask=n_mask[:, None, None] & live[None, :, :], other=0)
        blocks = k0 // 32 + g
        s = tl.load(s_rows[:, None] + blocks[None, :], mask=n_mask[:, None] & (blocks < K // 32)[None, :], other=127)
        # Each row's bf16 pairs of each word: [NB, 4 words, BLOCK_R, 4 pairs], split by pair.
        ptrs = a_rows[None, None, :, None] + (kw * 4)[:, :, None, None] + p4[None, None, None, :]
        pairs = tl.load(ptrs, mask=live[:, :, None, None] & a_mask[None, None, :, None], other=0)
        a02, a13 = tl.split(tl.reshape(pairs, [NB, 4, BLOCK_R, 2, 2]))
        a0, a2 = tl.split(a02)
        a1, a3 = tl.split(a13)
        p0, p1, p2, p3 = e2m1_word_pairs(w, INTERP)
        part = _lo(p0)[:, :, :, None] * _lo(a0)[None, :, :, :]
        part += _hi(p0)[:, :, :, None] * _hi(a0)[None, :, :, :]
        part += _lo(p1)[:, :, :, None] * _lo(a1)[None, :, :, :]
        part += _hi(p1)[:, :, :, None] * _hi(a1)[None, :, :, :]
        part += _lo(p2)[:, :, :, None] * _lo(a2)[None, :, :, :]
        part += _hi(p2)[:, :, :, None] * _hi(a2)[None, :, :, :]
        part += _lo(p3)[:, :, :, None] * _lo(a3)[None, :, :, :]
        part += _hi(p3)[:, :, :, None] * _hi(a3)[None, :, :, :]
        acc += part * ue8m0_to_f32(s)[:, :, None, None]
    return tl.sum(tl.sum(acc, 2), 1)


@triton.jit
def _chunk(serves, rank, c0, CHUNK: tl.constexpr):
    """[CHUNK, BLOCK_R] selector of the served rows ranked c0.. c0 + CHUNK - 1 (rank: among the served)."""
    j = tl.arange(0, CHUNK)
    return (rank[None, :] == (c0 + j)[:, None]) & serves[None, :]


@triton.jit
def _pick(sel, values, zero):
    """values [BLOCK_R] gathered by a [CHUNK, BLOCK_R] one-hot selector (zero where it picks none)."""
    return tl.sum(tl.where(sel, values[None, :], zero), 1)


@triton.jit
def shared_w13_dot(x_ptr, sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, act_ptr, pid_n, B, D, INTER, routed, stride_xb,
                   stride_ssn, limit, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, DOT_K: tl.constexpr,
                   NATIVE: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """The shared expert's (FP8) act rows of every batch row, rows pid_n of its intermediate: the dot tiles."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    n64 = offs_n.to(tl.int64)
    all_rows = tl.arange(0, BLOCK_B)
    every = all_rows < B
    x_rows = x_ptr + all_rows.to(tl.int64)[:, None] * stride_xb
    s_rows = (offs_n // 128) * stride_ssn
    g = _expert_tiles(x_rows, every, sw1_ptr + n64 * D, ss1_ptr + s_rows, n_mask, D, D,
                      True, BLOCK_N, DOT_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    u = _expert_tiles(x_rows, every, sw3_ptr + n64 * D, ss3_ptr + s_rows, n_mask, D, D,
                      True, BLOCK_N, DOT_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    ptrs = act_ptr + (routed + all_rows).to(tl.int64)[None, :] * INTER + offs_n[:, None]
    tl.store(ptrs, clamped_swiglu(g, u, limit).to(act_ptr.dtype.element_ty), mask=n_mask[:, None] & every[None, :])


@triton.jit
def shared_w2_dot(act_ptr, sw2_ptr, ss2_ptr, part_ptr, pid_n, B, D, INTER, routed, stride_ssn, BLOCK_N: tl.constexpr,
                  BLOCK_B: tl.constexpr, DOT_K: tl.constexpr, NATIVE: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """The shared expert's (FP8) w2 partials of every batch row, output rows pid_n: the dot tiles."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    all_rows = tl.arange(0, BLOCK_B)
    every = all_rows < B
    dest = routed + all_rows
    a_rows = act_ptr + dest.to(tl.int64)[:, None] * INTER
    acc = _expert_tiles(a_rows, every, sw2_ptr + offs_n.to(tl.int64) * INTER, ss2_ptr + (offs_n // 128) * stride_ssn,
                        n_mask, INTER, INTER, True, BLOCK_N, DOT_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    tl.store(part_ptr + dest.to(tl.int64)[None, :] * D + offs_n[:, None], acc, mask=n_mask[:, None] & every[None, :])


@triton.jit
def _w13_rows_kernel(
    x_ptr,
    idx_ptr,
    wts_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    sw1_ptr,
    ss1_ptr,
    sw3_ptr,
    ss3_ptr,
    act_ptr,
    B,
    D,
    INTER,
    stride_xb,
    stride_ssn,
    limit,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    DOT_K: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    routed = B * TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    n64 = offs_n.to(tl.int64)
    # (Names differ between the branches: compiled Triton types a name across an if.)
    if slot >= routed:
        shared_w13_dot(x_ptr, sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, act_ptr, pid_n, B, D, INTER, routed, stride_xb,
                       stride_ssn, limit, BLOCK_N, BLOCK_B, DOT_K, NATIVE, INTERP)  # fmt: skip
    else:
        e, _, owner, serves, weight, dest = _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_R)
        rows = tl.arange(0, BLOCK_R)
        rank = tl.cumsum(serves.to(tl.int32), 0) - 1
        w_off = e * INTER * (D // 8) + n64 * (D // 8)  # in words (D % 32 == 0)
        s_off = e * INTER * (D // 32) + n64 * (D // 32)
        w1_words = w1_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_off
        w3_words = w3_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_off
        x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        # The rows that chose the expert, CHUNK at a time (none on a slot that does not own it).
        for c0 in range(0, tl.sum(serves.to(tl.int32), 0), CHUNK):
            sel = _chunk(serves, rank, c0, CHUNK)
            live = tl.sum(sel.to(tl.int32), 1) > 0
            a_rows = x_words + _pick(sel, rows, 0).to(tl.int64) * (stride_xb // 2)
            g = _rows_fma(a_rows, live, w1_words, s1_ptr + s_off, n_mask, D, D, BLOCK_N, BLOCK_K, CHUNK, INTERP)
            u = _rows_fma(a_rows, live, w3_words, s3_ptr + s_off, n_mask, D, D, BLOCK_N, BLOCK_K, CHUNK, INTERP)
            act = clamped_swiglu(g, u, limit) * _pick(sel, weight, 0.0)[None, :]
            ptrs = act_ptr + _pick(sel, dest, 0).to(tl.int64)[None, :] * INTER + offs_n[:, None]
            tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=n_mask[:, None] & live[None, :])


@triton.jit
def _w2_rows_kernel(
    act_ptr,
    idx_ptr,
    wts_ptr,
    w2_ptr,
    s2_ptr,
    sw2_ptr,
    ss2_ptr,
    part_ptr,
    B,
    D,
    INTER,
    stride_ssn,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    DOT_K: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    routed = B * TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    n64 = offs_n.to(tl.int64)
    if slot >= routed:
        shared_w2_dot(act_ptr, sw2_ptr, ss2_ptr, part_ptr, pid_n, B, D, INTER, routed, stride_ssn, BLOCK_N, BLOCK_B,
                      DOT_K, NATIVE, INTERP)  # fmt: skip
    else:
        e, _, owner, serves, _, dest = _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_R)
        rank = tl.cumsum(serves.to(tl.int32), 0) - 1
        act_words = act_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        w_rows = w2_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + e * D * (INTER // 8) + n64 * (INTER // 8)
        s_rows = s2_ptr + e * D * (INTER // 32) + n64 * (INTER // 32)
        for c0 in range(0, tl.sum(serves.to(tl.int32), 0), CHUNK):
            sel = _chunk(serves, rank, c0, CHUNK)
            live = tl.sum(sel.to(tl.int32), 1) > 0
            dest_c = _pick(sel, dest, 0).to(tl.int64)
            acc = _rows_fma(act_words + dest_c * (INTER // 2), live, w_rows, s_rows, n_mask, INTER, INTER, BLOCK_N,
                            BLOCK_K, CHUNK, INTERP)  # fmt: skip
            ptrs = part_ptr + dest_c[None, :] * D + offs_n[:, None]
            tl.store(ptrs, acc, mask=n_mask[:, None] & live[None, :])


def launch_w13(grid, *args, **meta):
    _w13_rows_kernel[grid](*args, **meta)


def launch_w2(grid, *args, **meta):
    _w2_rows_kernel[grid](*args, **meta)


__all__ = ["launch_w13", "launch_w2", "shared_w13_dot", "shared_w2_dot"]
