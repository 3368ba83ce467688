"""Batch-1 decode GEMV (out[B, N] = x[B, K] @ W[N, K]^T) and a one-pass row RMS norm.

At batch 1 these read each weight byte once, so their speed is the weight bytes over
memory bandwidth. Two variants, by ``GemvConfig.use_dot``:
- FMA (batch 1 only; the tuned default there): narrow row blocks over long K runs, fp32
  [BLOCK_N, BLOCK_K] partial products summed over K once after the loop. Thousands of
  programs keep every SM streaming; 4.42 TB/s on the 1 GB LM head of an H200.
- dot (any batch): W streamed in [BLOCK_N, BLOCK_K] tiles through the software pipeline
  and multiplied by the activation tile with ``tl.dot`` (activations padded to 16 rows,
  W as the wide M side). An FMA config asked for at batch > 1 runs as ``BATCHED``.

Options, all constexpr:
- ``PRO_NORM``: the activation is RMS-normed in a prologue (weight ``nw``), rounded to
  the weight dtype as the reference's bf16 norm output is. Used for q_norm -> wq_b.
- ``GROUPED``: rows [g*G, (g+1)*G) read x columns [g*K, (g+1)*K) (the grouped wo_a).
- ``TWO_W``: rows >= N_A come from a second matrix (wq_a and wkv share one launch).
- ``SPLIT_K``: program k of the split writes its partial sums to out + k * stride_os.

Under PDL (``_common``) each program loads its first W tile before waiting on the kernel
before it, so W must be a weight: nothing earlier in the stream may write it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from draftgraph.ops.quantised import is_quantised
from draftgraph.ops.triton._common import batch_block, interpreting, mma, next_pow2, pdl_args, pdl_wait, rows_view
from draftgraph.ops.triton.fp8_round import round_row, w8a8_input


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = True


DEFAULT = GemvConfig()
BATCHED = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)  # any FMA config at batch > 1
# Tuned on an H200 at V4-Flash shapes, batch 1 (benchmarks/bench_kernels.py --tune;
# benchmarks/h200/KERNEL_RUNS.md, "Device run 2"):
# narrow FMA row blocks over long K runs won at batch 1 (more programs, 16-byte loads, no
# padding to 16 activation rows); the dot variant at n64 k128 is within 1% on the LM head.
LM_HEAD_CONFIG = GemvConfig(block_n=4, block_k=2048, num_warps=4, num_stages=3, use_dot=False)
LINEAR_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3, use_dot=False)


@triton.jit
def _load_w_tile(w_rows, kk, n_mask, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(w_rows + kk[None, :])
    else:
        return tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, w, x_rows, nw_ptr, inv, kk, row_mask, K, PRO_NORM: tl.constexpr, USE_DOT: tl.constexpr,
                INTERP: tl.constexpr):
    """acc += W tile x the matching activation columns (normed first under PRO_NORM)."""
    xv = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
    if PRO_NORM:
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * inv[:, None] * nw[None, :]).to(w.dtype)
    if USE_DOT:
        acc += mma(w, tl.trans(xv.to(w.dtype)), INTERP)
    else:
        xf = xv.to(w.dtype).to(tl.float32)  # the same rounding as the dot path
        acc += w.to(tl.float32) * xf
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    w2_ptr,
    nw_ptr,
    out_ptr,
    B,
    N,
    N_A,
    K,
    stride_xb,
    stride_wn,
    stride_w2n,
    stride_ob,
    stride_os,
    group_rows,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    EVEN_W: tl.constexpr,
    GROUPED: tl.constexpr,
    TWO_W: tl.constexpr,
    PRO_NORM: tl.constexpr,
    USE_DOT: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)  # BLOCK_B = 1 without dot
    row_mask = rows < B

    if TWO_W:
        if n0 >= N_A:
            w_rows = w2_ptr + (offs_n - N_A).to(tl.int64)[:, None] * stride_w2n
        else:
            w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    else:
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_col0 = 0
    if GROUPED:
        x_col0 = (n0 // group_rows) * K
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xb + x_col0
    k_begin = pid_k * K_PER_SPLIT
    # The first weight tile is loaded before pdl_wait: weights are constant during a step,
    # so under PDL this read overlaps the previous kernel's tail (see _common).
    w_first = _load_w_tile(w_rows, k_begin + offs_k, n_mask, K, EVEN_W)
    pdl_wait(PDL)

    if PRO_NORM:
        ss = tl.zeros([BLOCK_B], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            xv = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
            xv = xv.to(tl.float32)
            ss += tl.sum(xv * xv, 1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    else:
        inv = tl.zeros([BLOCK_B], dtype=tl.float32)

    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced over K once, after the loop
    acc = _accumulate(acc, w_first, x_rows, nw_ptr, inv, k_begin + offs_k, row_mask, K, PRO_NORM, USE_DOT, INTERP)
    for k0 in range(k_begin + BLOCK_K, k_begin + K_PER_SPLIT, BLOCK_K):
        kk = k0 + offs_k
        w = _load_w_tile(w_rows, kk, n_mask, K, EVEN_W)
        acc = _accumulate(acc, w, x_rows, nw_ptr, inv, kk, row_mask, K, PRO_NORM, USE_DOT, INTERP)

    out_rows = out_ptr + pid_k * stride_os + rows.to(tl.int64)[None, :] * stride_ob
    if USE_DOT:
        tl.store(
            out_rows + offs_n[:, None],
            acc.to(out_ptr.dtype.element_ty),
            mask=n_mask[:, None] & row_mask[None, :],
        )
    else:
        tl.store(
            out_rows + offs_n[:, None],
            tl.sum(acc, 1)[:, None].to(out_ptr.dtype.element_ty),
            mask=n_mask[:, None] & row_mask[None, :],
        )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    w2: torch.Tensor | None = None,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
    group_rows: int = 0,
    split_k: int = 1,
    config: GemvConfig = DEFAULT,
) -> None:
    """out[B, N] = x[B, K] @ [W; W2]^T, optionally normed x or grouped columns (see module doc).

    x and out may be strided views with unit last stride; with ``split_k`` > 1, out is
    [split_k, B, N] fp32 partials. ``K`` is W's column count.
    """
    b = x.shape[0]
    k = w.shape[1]
    n_a = w.shape[0]
    n = n_a + (w2.shape[0] if w2 is not None else 0)
    cfg = config
    if not cfg.use_dot and b != 1:
        cfg = BATCHED  # the FMA variant holds one activation row
    block_n = min(cfg.block_n, max(16 if cfg.use_dot else 1, next_pow2(n)))
    block_k = min(cfg.block_k, max(16, next_pow2(k)))
    while block_n > 1 and ((w2 is not None and n_a % block_n) or (group_rows and group_rows % block_n)):
        block_n //= 2  # a row block must not straddle the two matrices or two groups
    if cfg.use_dot and block_n < 16:
        if b != 1:
            raise ValueError(
                f"gemv: row blocks of 16 must tile {n_a} rows / groups of {group_rows} at batch {b}"
            )
        cfg = GemvConfig(block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, use_dot=False)
    while split_k > 1 and block_k > 16 and k % (split_k * block_k):
        block_k //= 2  # each part of K a whole number of tiles
    if k % (split_k * block_k) and split_k > 1:
        raise ValueError(f"gemv: K {k} must split into {split_k} x {block_k}")
    k_per = k // split_k if split_k > 1 else triton.cdiv(k, block_k) * block_k
    block_b = batch_block(b) if cfg.use_dot else 1
    grid = (triton.cdiv(n, block_n), triton.cdiv(b, block_b), split_k)
    w2_ = w2 if w2 is not None else w
    nw = norm_w if norm_w is not None else w
    stride_os = out.stride(0) if split_k > 1 else 0
    out2 = out[0] if split_k > 1 else out
    _gemv_kernel[grid](
        x,
        w,
        w2_,
        nw,
        out2,
        b,
        n,
        n_a,
        k,
        x.stride(0),
        w.stride(0),
        w2_.stride(0),
        out2.stride(0),
        stride_os,
        max(group_rows, 1),
        float(eps),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_B=block_b,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per,
        EVEN_W=(n % block_n == 0) and (k % block_k == 0),
        GROUPED=bool(group_rows),
        TWO_W=w2 is not None,
        PRO_NORM=norm_w is not None,
        USE_DOT=cfg.use_dot,
        INTERP=interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_args(x.device),
    )


# ---- rms_norm: one program per row ---------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, idx_ptr, D, stride_x, stride_o, eps, BLOCK_D: tl.constexpr,
                     ROUND_FP8: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    src = tl.load(idx_ptr + row) if GATHER else row  # GATHER: out row r norms x[idx[r]] (an embedding row)
    norm_row(x_ptr + src * stride_x, w_ptr, out_ptr + row * stride_o, D, eps, BLOCK_D, ROUND_FP8)


@triton.jit
def norm_row(src, w_ptr, dst, D, eps, BLOCK_D: tl.constexpr, ROUND_FP8: tl.constexpr = False):
    """dst[:D] = w * src / rms(src), fp32 math, rounded to dst's dtype as the bf16 norm's output is;
    under ROUND_FP8 (W8A8, BLOCK_D >= 128) that output then rounded through FP8 per run of 128."""
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    y = (x * inv * w).to(dst.dtype.element_ty)
    if ROUND_FP8:
        y = round_row(y.to(tl.float32), BLOCK_D).to(dst.dtype.element_ty)
    tl.store(dst + offs, y, mask=mask)


def norm_block(d: int, round_fp8: bool) -> int:
    """A norm row's tile: d's next power of two, at least one run of 128 when the row is rounded through FP8."""
    return max(next_pow2(d), 128) if round_fp8 else next_pow2(d)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, round_fp8: bool = False,
                  index: torch.Tensor | None = None):
    """out = weight * x / rms(x) over the last dim, row by row (x, out: [R, D], unit last stride);
    ``round_fp8``: then rounded through FP8 per run of 128 (W8A8's GEMV input, fp8_round's rounding).
    ``index`` (int64 [R'] on x's device, each in [0, R)): out row r norms x[index[r]] (out: [R', D])."""
    rows, d = x.shape if index is None else (index.shape[0], x.shape[1])
    block = norm_block(d, round_fp8)
    _rms_norm_kernel[(rows,)](
        x,
        weight,
        out,
        x if index is None else index,
        d,
        x.stride(0),
        out.stride(0),
        float(eps),
        BLOCK_D=block,
        ROUND_FP8=round_fp8,
        GATHER=index is not None,
        num_warps=4 if block <= 4096 else 8,
        **pdl_args(x.device),
    )


# ---- registered implementations --------------------------------------------------------------

_HALF = (torch.bfloat16, torch.float16)


def linear_impl(inputs, outputs, attrs, workspace):
    from draftgraph.ops.basic import _linear_impl

    x, w = inputs
    (out,) = outputs
    x2, o2 = rows_view(x), rows_view(out)
    if is_quantised(w):  # FP8 (unsupported_block_scaled): fp8_gemv on the stored bytes, W8A8 rounding first
        if x.dtype not in _HALF or x2 is None or o2 is None or w.fmt != "fp8" or not _dense(w):
            return _linear_impl(inputs, outputs, attrs, workspace)
        _fp8().project(w8a8_input(x2, w, attrs), w, o2, config=LINEAR_CONFIG)
        return
    if x.dtype not in _HALF or w.dtype != x.dtype or x2 is None or o2 is None or w.stride(1) != 1:
        return _linear_impl(inputs, outputs, attrs, workspace)
    gemv(x2, w, o2, config=LINEAR_CONFIG)


def _linear_block_scaled(specs) -> str | None:
    w = specs[1]
    return None if w.quant == "fp8" else f"no {w.quant} GEMV kernel (MXFP4 is read by the MoE kernel only)"


linear_impl.unsupported_block_scaled = _linear_block_scaled


def rms_norm_impl(inputs, outputs, attrs, workspace):
    from draftgraph.ops.basic import _rms_norm_impl

    x, w = inputs
    x2, o2 = rows_view(x), rows_view(outputs[0])
    if x2 is None or o2 is None or x.shape[-1] > 16384 or not w.is_contiguous():
        return _rms_norm_impl(inputs, outputs, attrs, workspace)
    rms_norm_rows(x2, w, float(attrs["eps"]), o2)


def _dense(w) -> bool:
    return w.data.is_contiguous() and w.scale.is_contiguous()


def _fp8():
    # fp8_linear imports this module (GemvConfig, gemv): imported where used, not at the top.
    from draftgraph.ops.triton import fp8_linear

    return fp8_linear
