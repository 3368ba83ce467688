"""moe / moe_hash decode: four launches, experts read in place from the stacked weights.

1. gate: split-K GEMV of x against W_g [E, D] -> fp32 partial logits [S, B, E].
2. route, one program per row: sums the partials, s = sqrt(softplus(.)), top-k of s + bias
   (the bias steers selection only) or tid2eid[token] for moe_hash; writes the expert id
   and routing weight s_e / sum(s_chosen) * scale of each (row, k) slot.
3. w13, grid (I blocks, B*K + 1 slots): streams w1[e], w3[e] rows straight out of the
   [E, I, D] stack (no gather copy) and writes act = weight * silu(min(g, limit)) *
   clamp(u, -limit, limit) in bf16 (the reference rounds act before w2 too). The last
   slot is the shared expert for every row, weight 1.
4. w2, grid (D blocks): one flat (slot, k) loop over the B*K routed slots and the shared
   slot, so the pipeline never drains between experts; fp32 accumulation over all
   experts, one bf16 store.

w13 and w2 have a dot variant (any batch; activations padded to 16 rows) and an FMA
variant (batch 1: one activation row, no padding), chosen by ``use_dot`` of their configs
at batch 1. From ``GROUPED_MIN_BATCH`` rows on, w13 and w2 are the expert-major kernels of
``moe_grouped`` (each chosen expert read once for all its rows) plus a reduce.

Native weights (issue 28.2): MXFP4 routed experts with an FP8 shared expert run launches 1 and
2 as they are, then ``moe_mxfp4.moe_mxfp4_launches`` (w13 and w2 reading the stored bytes and
scales; expert-major plus its reduce at batch > 1) on the rest of the scratch. W8A8
(``attrs["activations"] == "fp8"``) rounds x into scratch before w13 and the act rows in place
between w13 and w2 (a ``fp8_round.fp8_round_rows`` launch each, not fused; the gate reads x as
it is, as the torch op's).

moe_shard (expert-parallel, docs/SHARDING.md): the same launches on this rank's [E/W, ...] expert
stacks. The gate and the route run over all E experts (every rank picks the same ones); the route
then rewrites each pair's global id to its local one, or to ``NO_EXPERT`` with weight 0 when the
expert is another rank's, and every expert kernel skips a ``NO_EXPERT`` slot: it reads no weight
bytes and adds nothing (the w13 slot writes act 0; the w2 loop's loads are masked off; expert-major,
the slot owns nothing and the reduce skips it). The shared expert's slot is there only on the rank
that holds it. The output is the rank's fp32 partial (the kernels store into the output's dtype).

Note "routing precision": gate logits are fp32 sums of exact bf16 products, so the top-k
matches the torch op's except for near-ties (|gap| ~ 1e-6), where either choice is right.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.quantised import is_quantised, w8a8_rounds
from draftgraph.ops.triton import moe_grouped, moe_mxfp4
from draftgraph.ops.triton._common import (
    batch_block,
    carve,
    clamped_swiglu,
    interpreting,
    mma,
    next_pow2,
    pdl_args,
    pdl_wait,
    scratch_bytes,
    softplus,
    splat,
)
from draftgraph.ops.triton.fp8_round import fp8_round_rows
from draftgraph.ops.triton.gemv import GemvConfig, gemv

MAX_BATCH = 64  # the shared slot covers all rows in one tile; larger batches use torch
NO_EXPERT = -1  # the route's id for a pair whose expert another rank holds (moe_shard): every kernel skips it
# From this batch on, w13 / w2 are expert-major (moe_grouped: each chosen expert read once for
# all the rows that chose it); below it, slot-major (no bookkeeping, nothing read twice at B=1).
GROUPED_MIN_BATCH = 2
GATE_SPLIT = 8
GATE_CONFIG = GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=3)
# Batch 1 (FMA allowed) and batched (dot) configs of the two expert kernels, tuned on an H200
# at V4-Flash shapes (benchmarks/h200/KERNEL_RUNS.md, "Device run 2"): at batch 1 FMA beat the best
# dot tiles by 14 us (w13) and 23 us (w2).
W13_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False)
W2_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False)
W13_CONFIG_BATCHED = GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
# w2 batched: the w13 tile's shape and program count. The expert-major grid has a program per
# (tile, slot) and most slots own no expert; [16, 512] tiles made it 49k programs at B=32, with
# 144 KB of shared memory each (one per SM): 429 us for w2 against 250 for w13 (twice the bytes).
W2_CONFIG_BATCHED = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)


@triton.jit
def _moe_route_kernel(
    gpart_ptr,
    bias_ptr,
    token_ptr,
    tid2eid_ptr,
    idx_ptr,
    wts_ptr,
    B,
    E,
    SPLIT,
    stride_tid,
    scaling,
    expert_lo,
    num_local,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    HASH: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_k = tl.arange(0, TOPK_PAD)
    e_mask = offs_e < E
    part = tl.load(
        gpart_ptr + offs_s[:, None] * (B * E) + b * E + offs_e[None, :],
        mask=(offs_s < SPLIT)[:, None] & e_mask[None, :],
        other=0.0,
    )
    score = tl.sqrt(softplus(tl.sum(part, 0)))  # [BLOCK_E]
    if HASH:
        tok = tl.load(token_ptr + b)
        ids = tl.load(tid2eid_ptr + tok * stride_tid + offs_k, mask=offs_k < TOPK, other=-1)
        chosen = tl.sum(tl.where(offs_e[None, :] == ids[:, None], score[None, :], 0.0), 1)  # [TOPK_PAD]
    else:
        bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
        biased = tl.where(e_mask, score + bias, float("-inf"))
        ids = offs_k * 0
        chosen = offs_k * 0.0
        for j in tl.static_range(TOPK):
            best = tl.max(biased, 0)
            e_j = tl.min(tl.where(biased == best, offs_e, BLOCK_E), 0)  # lowest id among ties
            s_j = tl.sum(tl.where(offs_e == e_j, score, 0.0), 0)
            ids = tl.where(offs_k == j, e_j, ids)
            chosen = tl.where(offs_k == j, s_j, chosen)
            biased = tl.where(offs_e == e_j, float("-inf"), biased)
    k_mask = offs_k < TOPK
    chosen = tl.where(k_mask, chosen, 0.0)
    weights = chosen / tl.sum(chosen, 0) * scaling
    # Experts [expert_lo, expert_lo + num_local) are this launch's (all E but in moe_shard): local ids;
    # any other expert's pair becomes NO_EXPERT with weight 0 (weights renormalised over all K first).
    here = (ids >= expert_lo) & (ids < expert_lo + num_local)
    ids = tl.where(here, ids - expert_lo, -1)
    weights = tl.where(here, weights, 0.0)
    tl.store(idx_ptr + b * TOPK + offs_k, ids, mask=k_mask)
    tl.store(wts_ptr + b * TOPK + offs_k, weights, mask=k_mask)


@triton.jit
def _moe_w13_kernel(
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    routed_slots = B * TOPK
    is_shared = slot >= routed_slots
    b = tl.minimum(slot // TOPK, B - 1)
    safe = tl.minimum(slot, routed_slots - 1)
    e = tl.load(idx_ptr + safe).to(tl.int64)
    weight = tl.where(is_shared, 1.0, tl.load(wts_ptr + safe))

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < INTER
    rows = tl.arange(0, BLOCK_B)  # BLOCK_B = 1 without dot (batch 1: row 0 for every slot)
    row_mask = tl.where(is_shared, rows < B, rows == b)
    row_off = offs_n.to(tl.int64)[:, None] * D
    w1_rows = tl.where(is_shared, sw1_ptr + row_off, w1_ptr + e * INTER * D + row_off)
    w3_rows = tl.where(is_shared, sw3_ptr + row_off, w3_ptr + e * INTER * D + row_off)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xb

    if USE_DOT:
        acc1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    else:
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_end = tl.where(is_shared | (e >= 0), D, 0)  # NO_EXPERT reads nothing: act = swiglu(0, 0) * 0 = 0
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < D
        if EVEN_K:
            a1 = tl.load(w1_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            a3 = tl.load(w3_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
        else:
            a1 = tl.load(w1_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            a3 = tl.load(w3_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xv = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            xt = tl.trans(xv.to(a1.dtype))
            acc1 += mma(a1, xt, INTERP)
            acc3 += mma(a3, xt, INTERP)
        else:
            xf = xv.to(tl.float32)  # [1, BLOCK_K]
            acc1 += a1.to(tl.float32) * xf
            acc3 += a3.to(tl.float32) * xf

    if USE_DOT:
        act = clamped_swiglu(acc1, acc3, limit) * weight
    else:
        act = clamped_swiglu(tl.sum(acc1, 1), tl.sum(acc3, 1), limit)[:, None] * weight  # [BLOCK_N, 1]
    dest = tl.where(is_shared, routed_slots + rows, slot)  # act row of each tile column
    ptrs = act_ptr + dest.to(tl.int64)[None, :] * INTER + offs_n[:, None]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=n_mask[:, None] & row_mask[None, :])


@triton.jit
def _moe_w2_kernel(
    act_ptr,
    idx_ptr,
    w2_ptr,
    sw2_ptr,
    out_ptr,
    B,
    D,
    INTER,
    stride_ob,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    USE_DOT: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # One flat loop over (slot, k) so the pipeline never drains between experts; INTER % BLOCK_K == 0.
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < D
    rows = tl.arange(0, BLOCK_B)
    routed_slots = B * TOPK
    row_off = offs_n.to(tl.int64)[:, None] * INTER
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t in range(0, (routed_slots + HAS_SHARED) * INTER, BLOCK_K):
        slot = t // INTER
        k0 = t - slot * INTER
        shared = slot >= routed_slots
        e = tl.load(idx_ptr + tl.minimum(slot, routed_slots - 1)).to(tl.int64)
        w_rows = tl.where(shared, sw2_ptr + row_off, w2_ptr + e * D * INTER + row_off)
        live = n_mask & splat(shared | (e >= 0), offs_n)  # NO_EXPERT: nothing loaded (its act row is 0)
        w = tl.load(w_rows + k0 + offs_k[None, :], mask=live[:, None], other=0.0)
        if USE_DOT:
            src = tl.where(
                shared, tl.where(rows < B, routed_slots + rows, -1), tl.where(rows == slot // TOPK, slot, -1)
            )
            a = tl.load(
                act_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * INTER + k0 + offs_k[None, :],
                mask=(src >= 0)[:, None],
                other=0.0,
            )
            acc += mma(w, tl.trans(a.to(w.dtype)), INTERP)
        else:
            # Batch 1: the act row of a slot is the slot itself (the shared row comes last).
            a = tl.load(act_ptr + slot.to(tl.int64) * INTER + k0 + offs_k).to(tl.float32)
            acc += w.to(tl.float32) * a[None, :]
    ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_ob + offs_n[:, None]
    if USE_DOT:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (rows < B)[None, :])
    else:
        tl.store(ptrs, tl.sum(acc, 1)[:, None].to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def _route_parts(b: int, e: int, k: int):
    return [
        ((GATE_SPLIT, b, e), torch.float32),  # gate partial logits
        ((b * k,), torch.int32),  # chosen expert per routed slot (local id, or NO_EXPERT)
        ((b * k,), torch.float32),  # routing weight per routed slot
    ]


def _parts(b: int, e: int, k: int, inter: int, d: int, dtype: torch.dtype, shared: bool = True):
    slots = b * k + (b if shared else 0)
    return [
        *_route_parts(b, e, k),
        ((slots, inter), dtype),  # act rows: routed slots, then the shared expert per row (if any)
        ((slots if b >= GROUPED_MIN_BATCH else 0, d), torch.float32),  # expert-major w2 outputs per slot
    ]


def _configs(b: int) -> tuple[GemvConfig, GemvConfig]:
    if b == 1:
        return W13_CONFIG, W2_CONFIG
    return W13_CONFIG_BATCHED, W2_CONFIG_BATCHED


def plan(inputs, outputs, attrs, workspace, hashed: bool) -> list[tuple[str, callable]]:
    """The launches of one moe / moe_hash call, as (name, thunk); the impl runs them in order."""
    if hashed:
        x, token, tid2eid, gate_w, w1, w2, w3, sw1, sw2, sw3 = inputs
        bias, top_k = None, tid2eid.shape[1]
    else:
        x, gate_w, bias, w1, w2, w3, sw1, sw2, sw3 = inputs
        token = tid2eid = None
        top_k = int(attrs["top_k"])
    routing = (gate_w, bias, token, tid2eid, top_k)
    return _plan(x, routing, (w1, w2, w3), (sw1, sw2, sw3), 0, outputs[0], attrs, workspace)


def shard_plan(inputs, outputs, attrs, workspace) -> list[tuple[str, callable]]:
    """The launches of one moe_shard call: moe's on this rank's experts, the shared expert if held."""
    x, gate_w, bias, w1, w2, w3 = inputs[:6]
    shared = tuple(inputs[6:]) or None
    routing = (gate_w, bias, None, None, int(attrs["top_k"]))
    return _plan(x, routing, (w1, w2, w3), shared, int(attrs["expert_start"]), outputs[0], attrs, workspace)


def _plan(x, routing, experts, shared, expert_lo, out, attrs, workspace) -> list[tuple[str, callable]]:
    """gate + route over all experts, then the expert launches on the stacks ``experts`` [E_here, ...]
    holding experts [expert_lo, expert_lo + E_here); ``shared`` (sw1, sw2, sw3) or None."""
    gate_w, bias, token, tid2eid, top_k = routing
    hashed = tid2eid is not None
    w1, w2, w3 = experts
    has_shared = shared is not None
    # No shared slot: its pointers are never read (the grids have no shared slot); any tensors of the types.
    sw1, sw2, sw3 = shared if has_shared else experts
    b, d = x.shape
    e, num_local, inter = gate_w.shape[0], w1.shape[0], w1.shape[1]
    quant = is_quantised(w1)  # MXFP4 experts, FP8 shared expert (_usable)
    if quant:
        w8a8 = w8a8_rounds(w1, attrs)
        # One buffer for the route's scratch and moe_mxfp4's (carved again by act_rows): allocated
        # whole here when the op was given none, so both carve the same bytes.
        head, tail = _mxfp4_scratch(b, e, top_k, inter, d, x.dtype, w8a8, has_shared)
        if workspace is None or workspace.numel() < head + tail:
            workspace = torch.empty(head + tail, dtype=torch.uint8, device=x.device)
        gpart, idx, wts, xq = carve(workspace, x.device, _mxfp4_route_parts(b, e, top_k, d, x.dtype, w8a8))
        rest = workspace[head:]
    else:
        gpart, idx, wts, act, part = carve(workspace, x.device, _parts(b, e, top_k, inter, d, x.dtype, has_shared))
    split = GATE_SPLIT if d % (GATE_SPLIT * GATE_CONFIG.block_k) == 0 else 1
    interp = interpreting()
    c13, c2 = _configs(b)
    dot13, dot2 = c13.use_dot or b > 1, c2.use_dot or b > 1
    block_b = batch_block(b)

    def gate():
        if split > 1:
            gemv(x, gate_w, gpart, split_k=split, config=GATE_CONFIG)
        else:
            gemv(x, gate_w, gpart[0], config=GATE_CONFIG)

    def route():
        _moe_route_kernel[(b,)](
            gpart,
            bias if bias is not None else gpart,
            token if hashed else idx,
            tid2eid if hashed else idx,
            idx,
            wts,
            b,
            e,
            split,
            tid2eid.stride(0) if hashed else 0,
            float(attrs["routed_scaling_factor"]),
            expert_lo,
            num_local,
            TOPK=top_k,
            TOPK_PAD=next_pow2(top_k),
            BLOCK_E=next_pow2(e),
            SPLIT_PAD=next_pow2(split),
            HASH=hashed,
            num_warps=4,
            **pdl_args(x.device),
        )

    def w13():
        bn = min(c13.block_n, max(16 if dot13 else 1, next_pow2(inter)))
        bn = max(bn, 16) if dot13 else bn
        bk = min(c13.block_k, max(16, next_pow2(d)))
        _moe_w13_kernel[(triton.cdiv(inter, bn), b * top_k + (1 if has_shared else 0))](
            x,
            idx,
            wts,
            w1,
            w3,
            sw1,
            sw3,
            act,
            b,
            d,
            inter,
            x.stride(0),
            float(attrs["swiglu_limit"]),
            TOPK=top_k,
            BLOCK_N=bn,
            BLOCK_K=bk,
            BLOCK_B=block_b if dot13 else 1,
            EVEN_K=d % bk == 0,
            USE_DOT=dot13,
            INTERP=interp,
            num_warps=c13.num_warps,
            num_stages=c13.num_stages,
            **pdl_args(x.device),
        )

    def w2_():
        bn = min(c2.block_n, max(16 if dot2 else 1, next_pow2(d)))
        bn = max(bn, 16) if dot2 else bn
        bk = _w2_block_k(inter, c2)
        _moe_w2_kernel[(triton.cdiv(d, bn),)](
            act,
            idx,
            w2,
            sw2,
            out,
            b,
            d,
            inter,
            out.stride(0),
            TOPK=top_k,
            BLOCK_N=bn,
            BLOCK_K=bk,
            BLOCK_B=block_b if dot2 else 1,
            HAS_SHARED=has_shared,
            USE_DOT=dot2,
            INTERP=interp,
            num_warps=c2.num_warps,
            num_stages=c2.num_stages,
            **pdl_args(x.device),
        )

    if quant:
        experts = _mxfp4_launches(
            x,
            xq if w8a8 else None,
            idx.view(b, top_k),
            wts.view(b, top_k),
            (w1, w2, w3, *shared) if has_shared else (w1, w2, w3),
            out,
            rest,
            attrs,
        )
        return [("gate", gate), ("route", route), *experts]
    if b >= GROUPED_MIN_BATCH:
        limit = float(attrs["swiglu_limit"])
        grouped = moe_grouped.launches(
            x, idx, wts, w1, w3, w2, sw1, sw3, sw2, act, part, out, top_k, limit, c13, c2, block_b, interp,
            has_shared=has_shared,
        )  # fmt: skip
        return [("gate", gate), ("route", route), *grouped]
    return [("gate", gate), ("route", route), ("w13", w13), ("w2", w2_)]


def _mxfp4_route_parts(b: int, e: int, k: int, d: int, dtype: torch.dtype, w8a8: bool):
    return [*_route_parts(b, e, k), ((b if w8a8 else 0, d), dtype)]  # + x rounded through FP8 (W8A8)


def _mxfp4_scratch(
    b: int, e: int, k: int, inter: int, d: int, dtype: torch.dtype, w8a8: bool, shared: bool = True
) -> tuple[int, int]:
    """(bytes of the gate / route scratch, bytes of moe_mxfp4's scratch after it)."""
    grouped = b >= moe_mxfp4.GROUPED_MIN_BATCH
    return (
        scratch_bytes(_mxfp4_route_parts(b, e, k, d, dtype, w8a8)),
        moe_mxfp4.moe_mxfp4_workspace(b, k, inter, d, dtype, grouped, shared),
    )


def _mxfp4_launches(x, xq, idx, wts, weights, out, rest, attrs) -> list[tuple[str, callable]]:
    """moe_mxfp4's launches on the route's ids and weights; ``xq``: x's FP8-rounded copy (W8A8) or None.

    ``weights``: (w1, w2, w3, sw1, sw2, sw3), or (w1, w2, w3) without a shared expert (moe_shard off rank 0).
    """
    w1, w2, w3, *held = weights
    b, d = x.shape
    shared = None
    if held:
        sw1, sw2, sw3 = held
        shared = (sw1.data, sw1.scale, sw2.data, sw2.scale, sw3.data, sw3.scale)
    launches = moe_mxfp4.moe_mxfp4_launches(
        x if xq is None else xq, idx, wts, w1.data, w1.scale, w2.data, w2.scale, w3.data, w3.scale, out,
        swiglu_limit=float(attrs["swiglu_limit"]), shared=shared, workspace=rest,
        rebias=(_rebias_fits(w1, w3), _rebias_fits(w2)),
    )  # fmt: skip
    if xq is None:
        return launches
    grouped = b >= moe_mxfp4.GROUPED_MIN_BATCH
    parts = moe_mxfp4.moe_mxfp4_parts(b, idx.shape[1], w1.shape[1], d, x.dtype, grouped, shared is not None)
    act = carve(rest, x.device, parts)[0]

    def round_x():
        fp8_round_rows(x, out=xq)

    def round_act():  # every act row: the routed slots' and the shared expert's, before w2 reads them
        fp8_round_rows(act, out=act)

    at = [name for name, _ in launches].index("w13") + 1  # the act rows are w13's: rounded before w2 reads them
    return [("round_x", round_x), *launches[:at], ("round_act", round_act), *launches[at:]]


def _rebias_fits(*weights) -> bool:
    """``moe_mxfp4.rebias_fits`` of bound weights from their kept ``max_scale_byte`` (read once, at
    the first plan: the warm-up run before a capture); a capture that finds one unread takes the
    two-multiply decode, right for every scale, rather than read the device while capturing."""
    if any(w.data.is_cuda for w in weights) and torch.cuda.is_current_stream_capturing():
        if any("max_scale_byte" not in vars(w) for w in weights):
            return False
    return all(w.max_scale_byte <= moe_mxfp4.REBIAS_MAX_SCALE_BYTE for w in weights)


def _w2_block_k(inter: int, cfg: GemvConfig) -> int:
    return min(cfg.block_k, max(16, next_pow2(inter)))


def _usable(x, routing, experts, shared) -> bool:
    """Whether the fused kernels take these inputs: ``routing`` (gate, bias or tid2eid), ``experts``
    (w1, w2, w3), ``shared`` (sw1, sw2, sw3) or () (moe_shard off rank 0)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] > MAX_BATCH or x.stride(1) != 1:
        return False
    if any(map(is_quantised, (*experts, *shared))):
        return _usable_mxfp4(x, routing, experts, shared)
    inter = experts[0].shape[1]  # w1 [E, I, D]
    if any(inter % _w2_block_k(inter, c) for c in _configs(x.shape[0])):
        return False  # the w2 kernel's flat (slot, k) loop needs whole K blocks per slot
    return all(t.is_contiguous() for t in (*routing, *experts, *shared))


def _usable_mxfp4(x, routing, experts, shared) -> bool:
    def fmts(ws):
        return [getattr(w, "fmt", None) for w in ws]

    if _formats_gap(fmts(experts), fmts(shared)):
        return False
    if x.dtype != torch.bfloat16 or x.shape[0] > moe_mxfp4.MAX_BATCH:
        return False
    dense = [*routing, *(t for w in (*experts, *shared) for t in (w.data, w.scale))]
    return all(t.is_contiguous() for t in dense)


def _formats_gap(routed: list, shared: list) -> str | None:
    if all(f == "mxfp4" for f in routed) and all(f == "fp8" for f in shared):
        return None
    return (
        f"the fused MoE reads MXFP4 routed experts with an FP8 shared expert, got routed {routed}, "
        f"shared {shared} (FP8 routed experts: no FP8 expert kernel)"
    )


def moe_block_scaled(specs) -> str | None:
    """Why the fused moe / moe_hash cannot read these block-scaled experts, or None."""
    return _formats_gap([s.quant for s in specs[-6:-3]], [s.quant for s in specs[-3:]])


def moe_shard_block_scaled(specs) -> str | None:
    """Why the fused moe_shard cannot read these block-scaled experts, or None (no shared expert off rank 0)."""
    return _formats_gap([s.quant for s in specs[3:6]], [s.quant for s in specs[6:9]])


def moe_impl(inputs, outputs, attrs, workspace):
    x, gate_w, gate_bias, w1, w2, w3, sw1, sw2, sw3 = inputs
    if not _usable(x, (gate_w, gate_bias), (w1, w2, w3), (sw1, sw2, sw3)) or outputs[0].stride(1) != 1:
        from draftgraph.ops.moe import _moe_impl

        return _moe_impl(inputs, outputs, attrs, workspace)
    for _, launch in plan(inputs, outputs, attrs, workspace, hashed=False):
        launch()


def moe_hash_impl(inputs, outputs, attrs, workspace):
    x, token, tid2eid, gate_w, w1, w2, w3, sw1, sw2, sw3 = inputs
    if not _usable(x, (gate_w, tid2eid), (w1, w2, w3), (sw1, sw2, sw3)) or outputs[0].stride(1) != 1:
        from draftgraph.ops.moe import _moe_hash_impl

        return _moe_hash_impl(inputs, outputs, attrs, workspace)
    for _, launch in plan(inputs, outputs, attrs, workspace, hashed=True):
        launch()


def moe_shard_impl(inputs, outputs, attrs, workspace):
    """moe_shard fused: this rank's fp32 partial [B, D] (its experts' pairs, + the shared expert if held)."""
    x, gate_w, gate_bias, w1, w2, w3 = inputs[:6]
    if not _usable(x, (gate_w, gate_bias), (w1, w2, w3), tuple(inputs[6:])) or outputs[0].stride(1) != 1:
        from draftgraph.ops.moe import _moe_shard_impl

        return _moe_shard_impl(inputs, outputs, attrs, workspace)
    for _, launch in shard_plan(inputs, outputs, attrs, workspace):
        launch()


moe_impl.unsupported_block_scaled = moe_block_scaled
moe_hash_impl.unsupported_block_scaled = moe_block_scaled
moe_shard_impl.unsupported_block_scaled = moe_shard_block_scaled


def moe_workspace(specs, attrs, batch: int) -> int:
    """Scratch bytes of moe / moe_hash at a concrete batch (for the OpDef's workspace rule).

    MXFP4 experts: the gate / route scratch (and x rounded, W8A8), then moe_mxfp4's.
    """
    x, w1 = specs[0], specs[-6]
    k = int(attrs.get("top_k", 0)) or specs[2].shape[1]
    return _workspace(x, w1.shape[0], w1, k, True, attrs, batch)  # unsharded: w1 holds all E experts


def moe_shard_workspace(specs, attrs, batch: int) -> int:
    """Scratch bytes of the fused moe_shard at a concrete batch: moe's, on E/W experts, the shared rows if held."""
    x, gate_w, w1 = specs[0], specs[1], specs[3]
    return _workspace(x, gate_w.shape[0], w1, int(attrs["top_k"]), len(specs) == 9, attrs, batch)


def _workspace(x, e: int, w1, k: int, shared: bool, attrs, batch: int) -> int:
    inter, d = w1.shape[1], x.shape[1]
    if w1.is_quantised:
        return sum(_mxfp4_scratch(batch, e, k, inter, d, x.dtype, attrs.get("activations") == "fp8", shared))
    return scratch_bytes(_parts(batch, e, k, inter, d, x.dtype, shared))
