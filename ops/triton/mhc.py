"""mHC kernels: hc_pre (+ Sinkhorn), hc_head, hc_post.

hc_pre / hc_head, two launches each:
1. mix: split over the C*D columns; each program reads its slice of ``fn`` once (fp32,
   exact products, no tf32) and, for every batch row, writes the partial mix logits and
   the partial sum of squares to scratch [S, B, MP] (sum of squares in column MP-1).
2. finish: grid (B, D blocks). Each program sums the partials of its row, forms rho,
   pre / post / the Sinkhorn-normalised comb (hc_pre) or g (hc_head), and writes its
   block of y = sum_j w_j X_j; the D-block-0 program also writes post and comb. The
   4x4 Sinkhorn is recomputed by every program of the row: ~100 tiny ops, cheaper than
   a launch.

hc_post is one elementwise launch: X'[k] = post_k y + sum_j comb[j, k] X[j]. Each program
reads its D block of all C streams before writing it, so X' may alias X.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.triton._common import carve, next_pow2, scratch_bytes

MIX_BLOCK_K = 256
MIX_SPLIT_TARGET = 64  # programs of the mix kernel (column slices)
FINISH_BLOCK_D = 512
# One warp: the 4x4 Sinkhorn's 40 reductions are then warp shuffles, not shared-memory
# round trips with barriers (the 4-warp finish took ~6 us on an H200, mostly that loop).
FINISH_WARPS = 1


@triton.jit
def _hc_mix_kernel(
    x_ptr, fn_ptr, part_ptr, B, CD, M, stride_xb, K_PER: tl.constexpr, MP: tl.constexpr, BLOCK_K: tl.constexpr
):
    s = tl.program_id(0)
    offs_m = tl.arange(0, MP)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k_begin = s * K_PER
    for b in range(0, B):
        acc = tl.zeros([MP], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_begin + K_PER, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < CD
            x = tl.load(x_ptr + b * stride_xb + kk, mask=k_mask, other=0.0).to(tl.float32)
            f = tl.load(
                fn_ptr + offs_m[:, None] * CD + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc += tl.sum(f * x[None, :], 1)
            ss += x * x
        acc = tl.where(offs_m == MP - 1, tl.sum(ss, 0), acc)
        tl.store(part_ptr + (s * B + b) * MP + offs_m, acc)


@triton.jit
def _sum_parts(part_ptr, b, B, S, offs, MP: tl.constexpr, S_PAD: tl.constexpr):
    """sum over s of part[s, b, offs] for a 1-d index tensor ``offs``."""
    offs_s = tl.arange(0, S_PAD)
    v = tl.load(
        part_ptr + (offs_s[:, None] * B + b) * MP + offs[None, :], mask=(offs_s < S)[:, None], other=0.0
    )
    return tl.sum(v, 0)


@triton.jit
def _sum_parts_2d(part_ptr, b, B, S, offs, MP: tl.constexpr, S_PAD: tl.constexpr):
    """sum over s of part[s, b, offs] for a 2-d index tensor ``offs``."""
    offs_s = tl.arange(0, S_PAD)
    v = tl.load(
        part_ptr + (offs_s[:, None, None] * B + b) * MP + offs[None, :, :],
        mask=(offs_s < S)[:, None, None],
        other=0.0,
    )
    return tl.sum(v, 0)


@triton.jit
def _sum_parts_scalar(part_ptr, b, B, S, col, MP: tl.constexpr, S_PAD: tl.constexpr):
    offs_s = tl.arange(0, S_PAD)
    return tl.sum(tl.load(part_ptr + (offs_s * B + b) * MP + col, mask=offs_s < S, other=0.0), 0)


@triton.jit
def _hc_finish_kernel(
    x_ptr,
    part_ptr,
    base_ptr,
    scale_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    B,
    S,
    C,
    D,
    stride_xb,
    stride_yb,
    eps,
    hc_eps,
    iters,
    MP: tl.constexpr,
    S_PAD: tl.constexpr,
    C_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRE: tl.constexpr,
):
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_c = tl.arange(0, C_PAD)
    c_mask = offs_c < C
    ss = _sum_parts_scalar(part_ptr, b, B, S, MP - 1, MP, S_PAD)
    rho = 1.0 / tl.sqrt(ss / (C * D) + eps)
    m_w = _sum_parts(part_ptr, b, B, S, offs_c, MP, S_PAD) * rho  # [C_PAD]: pre (hc_pre) or g (hc_head)
    s0 = tl.load(scale_ptr)
    base_w = tl.load(base_ptr + offs_c, mask=c_mask, other=0.0)
    w = tl.where(c_mask, tl.sigmoid(m_w * s0 + base_w) + hc_eps, 0.0)

    if PRE:
        if pid_d == 0:
            # post = 2 sigmoid(m[C + j] * scale[1] + base[C + j])
            m_p = _sum_parts(part_ptr, b, B, S, C + offs_c, MP, S_PAD) * rho
            base_p = tl.load(base_ptr + C + offs_c, mask=c_mask, other=0.0)
            post = 2.0 * tl.sigmoid(m_p * tl.load(scale_ptr + 1) + base_p)
            tl.store(post_ptr + b * C + offs_c, post, mask=c_mask)
            # comb = Sinkhorn(L), L[j, k] = m[2C + C j + k] * scale[2] + base[2C + C j + k]
            jk = 2 * C + offs_c[:, None] * C + offs_c[None, :]
            valid = c_mask[:, None] & c_mask[None, :]
            jk = tl.where(valid, jk, 0)
            base_l = tl.load(base_ptr + jk, mask=valid, other=0.0)
            logits = _sum_parts_2d(part_ptr, b, B, S, jk, MP, S_PAD) * rho * tl.load(scale_ptr + 2) + base_l
            logits = tl.where(valid, logits, float("-inf"))
            e = tl.exp(logits - tl.max(logits, 1)[:, None])
            mat = tl.where(valid, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)  # row softmax + eps
            mat = mat / (tl.sum(mat, 0)[None, :] + hc_eps)  # column normalisation
            for _ in range(1, iters):
                mat = mat / (tl.sum(mat, 1)[:, None] + hc_eps)
                mat = mat / (tl.sum(mat, 0)[None, :] + hc_eps)
            tl.store(comb_ptr + b * C * C + offs_c[:, None] * C + offs_c[None, :], mat, mask=valid)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    xs = tl.load(
        x_ptr + b.to(tl.int64) * stride_xb + offs_c[:, None] * D + offs_d[None, :],
        mask=c_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    y = tl.sum(w[:, None] * xs.to(tl.float32), 0)
    tl.store(y_ptr + b.to(tl.int64) * stride_yb + offs_d, y.to(y_ptr.dtype.element_ty), mask=d_mask)


def _split(cd: int) -> tuple[int, int]:
    """(programs, columns per program) of the mix kernel: a multiple of MIX_BLOCK_K each."""
    block = min(MIX_BLOCK_K, next_pow2(cd))
    chunks = triton.cdiv(cd, block)
    split = min(MIX_SPLIT_TARGET, chunks)
    per = triton.cdiv(chunks, split) * block
    return triton.cdiv(cd, per), per


def _mix_pad(m: int) -> int:
    return next_pow2(m + 1)  # room for the sum of squares in the last column


def _parts(b: int, cd: int, m: int):
    split, _ = _split(cd)
    return [((split, b, _mix_pad(m)), torch.float32)]


def _usable(X, tensors) -> bool:
    return (
        X.dim() == 3
        and X.stride(2) == 1
        and X.stride(1) == X.shape[2]
        and all(t.is_contiguous() for t in tensors)
    )


def _mix_and_finish(X, fn, base, scale, y, post, comb, attrs, workspace, pre: bool) -> None:
    b, c, d = X.shape
    m = fn.shape[0]
    mp = _mix_pad(m)
    split, per = _split(c * d)
    (part,) = carve(workspace, X.device, _parts(b, c * d, m))
    _hc_mix_kernel[(split,)](
        X,
        fn,
        part,
        b,
        c * d,
        m,
        X.stride(0),
        K_PER=per,
        MP=mp,
        BLOCK_K=min(MIX_BLOCK_K, next_pow2(c * d)),
        num_warps=4,
    )
    block_d = min(FINISH_BLOCK_D, next_pow2(d))
    _hc_finish_kernel[(b, triton.cdiv(d, block_d))](
        X,
        part,
        base,
        scale,
        y,
        post if pre else y,
        comb if pre else y,
        b,
        split,
        c,
        d,
        X.stride(0),
        y.stride(0),
        float(attrs["eps"]),
        float(attrs["hc_eps"]),
        int(attrs.get("iters", 1)),
        MP=mp,
        S_PAD=next_pow2(split),
        C_PAD=next_pow2(c),
        BLOCK_D=block_d,
        PRE=pre,
        num_warps=FINISH_WARPS,
    )


def hc_pre_impl(inputs, outputs, attrs, workspace):
    X, fn, base, scale = inputs
    y, post, comb = outputs
    if not _usable(X, (fn, base, scale, post, comb)) or y.stride(1) != 1:
        from ops.mhc import _hc_pre_impl

        return _hc_pre_impl(inputs, outputs, attrs, workspace)
    _mix_and_finish(X, fn, base, scale, y, post, comb, attrs, workspace, pre=True)


def hc_head_impl(inputs, outputs, attrs, workspace):
    X, fn, base, scale = inputs
    (y,) = outputs
    if not _usable(X, (fn, base, scale)) or y.stride(1) != 1:
        from ops.mhc import _hc_head_impl

        return _hc_head_impl(inputs, outputs, attrs, workspace)
    _mix_and_finish(X, fn, base, scale, y, None, None, attrs, workspace, pre=False)


def hc_mix_workspace(specs, attrs, batch: int) -> int:
    """Scratch bytes of hc_pre / hc_head at a concrete batch."""
    X, fn = specs[0], specs[1]
    return scratch_bytes(_parts(batch, X.shape[1] * X.shape[2], fn.shape[0]))


# ---- hc_post ---------------------------------------------------------------------------------


@triton.jit
def _hc_post_kernel(
    y_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    C,
    D,
    stride_yb,
    stride_xb,
    stride_ob,
    C_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, C_PAD)
    c_mask = offs_c < C
    d_mask = offs_d < D
    b64 = b.to(tl.int64)
    xs = tl.load(
        x_ptr + b64 * stride_xb + offs_c[:, None] * D + offs_d[None, :],
        mask=c_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [Cj, BD]
    y = tl.load(y_ptr + b64 * stride_yb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    comb = tl.load(
        comb_ptr + b * C * C + offs_c[:, None] * C + offs_c[None, :],
        mask=c_mask[:, None] & c_mask[None, :],
        other=0.0,
    )  # [Cj, Ck]
    post = tl.load(post_ptr + b * C + offs_c, mask=c_mask, other=0.0)  # [Ck]
    mixed = tl.sum(comb[:, :, None] * xs[:, None, :], 0)  # [Ck, BD]: comb transposed onto X
    out = mixed + post[:, None] * y[None, :]
    tl.store(
        out_ptr + b64 * stride_ob + offs_c[:, None] * D + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=c_mask[:, None] & d_mask[None, :],
    )


HC_POST_BLOCK_D = 512


def hc_post_impl(inputs, outputs, attrs, workspace):
    y, X, post, comb = inputs
    (out,) = outputs
    if not (_usable(X, (post, comb)) and _usable(out, ())) or y.stride(1) != 1:
        from ops.mhc import _hc_post_impl

        return _hc_post_impl(inputs, outputs, attrs, workspace)
    b, c, d = X.shape
    block_d = min(HC_POST_BLOCK_D, next_pow2(d))
    _hc_post_kernel[(b, triton.cdiv(d, block_d))](
        y,
        X,
        post,
        comb,
        out,
        c,
        d,
        y.stride(0),
        X.stride(0),
        out.stride(0),
        C_PAD=next_pow2(c),
        BLOCK_D=block_d,
        num_warps=4,
    )
