"""mHC kernels: hc_pre (+ Sinkhorn), hc_head, hc_post.

hc_pre / hc_head, two launches each:
1. mix: grid (column slices of C*D, row tiles of ``MIX_ROWS``); each program reads its
   slice of ``fn`` (fp32, exact products, no tf32) for each of its batch rows and writes
   the partial mix logits and the partial sum of squares to scratch [S, B, MP] (sum of
   squares in column MP-1).
2. finish: grid (B, D blocks + 1 for hc_pre). Each program sums the partials of its row,
   forms rho and pre (hc_pre) or g (hc_head), and writes its block of y = sum_j w_j X_j;
   hc_pre's last program of the row writes post and the Sinkhorn-normalised comb instead (the
   Sinkhorn: for C = 4 on 16 scalars every thread holds, so its 2 x iters normalisations
   need no cross-thread reduction; other C in the [C, C] tensor form).

Note "comb apart": until the sixteenth session the D-block-0 program made post and comb, then
its y block: the Sinkhorn (40 normalisations, one dependent chain) sat before y on the path of
the next launch. An ncu profile of the B=1 chain on an H100 (benchmarks/h200/
ncu_chain_b1_b32_h100.txt) gave hc_pre_norm's finish 12.2-12.6 us on one SM, ~4,450 instructions
a warp of which ~3,050 FP32 (the Sinkhorn's adds and divisions) at 3.7 cycles each, where
hc_head's finish (no Sinkhorn) took 3.7. Now a program of its own makes post and comb beside
the y programs, and each normalisation is one reciprocal (``rcp.approx``, 1 ulp) and four
multiplies, where it was four divisions (``div.full``, 2 ulp, several instructions each). The
chain, one process (benchmarks/h200/sinkhorn_drop_one_process_h100_log.txt, best of three):
B=1 0.5367 -> 0.5354 ms with the reciprocals, 0.5330 with both; B=8 0.6749 -> 0.6711 / 0.6685;
B=32 0.9220 -> 0.9174 / 0.9154.

Note "norm in the finish": hc_pre_norm (the fold_norm_into_hc_pre pass's op) runs the finish as
one program a row with the whole row in one tile (``NORM_WARPS``), which stores y and then,
after a barrier, norms the row in place with the norm launch's own arithmetic (``gemv.norm_row``).
Its sums (the mix partials, the row's squares) run on NORM_WARPS warps where hc_pre's finish
runs FINISH_WARPS and the norm launch 4, so on the GPU y may differ from the two launches' by a
rounding (the interpreter: the same bits). At B=1 the y of hc_pre was 8 programs of 512
columns; one program now reads the row's C x D (32 KB at V4-Flash) and the norm's launch is
gone. Measured in the chain on an H100, in one process against the two launches (NORM_MAX_D 0;
benchmarks/h200/norm_fold_one_process_8a3b327_h100_log.txt, two rows each): B=1 0.5396 ->
0.5350 / 0.5379 ms, B=8 0.6719 -> 0.6726 / 0.6722, B=32 0.9109 -> 0.9059 / 0.9029; two kernel
nodes fewer a step. 4 warps about the same (B=8 0.6694 / 0.6699), 16 slower.

hc_post is one elementwise launch: X'[k] = post_k y + sum_j comb[j, k] X[j]. Each program
reads its D block of all C streams before writing it, so X' may alias X.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.triton._common import carve, interpreting, next_pow2, pdl_args, pdl_wait, scratch_bytes
from draftgraph.ops.triton.gemv import norm_row, rms_norm_rows

MIX_BLOCK_K = 256
MIX_SPLIT_TARGET = 64  # programs of the mix kernel (column slices)
# Batch rows per mix program (the grid's second dim is row tiles). Each row re-reads the
# program's fn slice from L2; with all B rows in one program those reads were serial:
# 39 us a launch at B=32 on an H200, against ~3 at B=1.
MIX_ROWS = 1
FINISH_BLOCK_D = 512
# One warp: the 4x4 Sinkhorn's 40 reductions are then warp shuffles, not shared-memory
# round trips with barriers (the 4-warp finish took ~6 us on an H200, mostly that loop).
FINISH_WARPS = 1
# hc_pre_norm's finish: a program a row, its whole y in one tile (note "norm in the finish"); up
# to NORM_MAX_D columns (V4-Flash: 4096), past it hc_pre's finish and a norm launch.
NORM_WARPS = 8
NORM_MAX_D = 8192


@triton.jit
def _hc_mix_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    B,
    CD,
    M,
    stride_xb,
    K_PER: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    s = tl.program_id(0)
    offs_m = tl.arange(0, MP)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k_begin = s * K_PER
    for i in range(0, ROWS):
        b = tl.program_id(1) * ROWS + i
        row_k = (offs_k * 0 + b) < B  # the last row tile may be short (vectors: masks must be tensors)
        acc = tl.zeros([MP], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_begin + K_PER, BLOCK_K):
            kk = k0 + offs_k
            k_mask = (kk < CD) & row_k
            x = tl.load(x_ptr + b * stride_xb + kk, mask=k_mask, other=0.0).to(tl.float32)
            f = tl.load(
                fn_ptr + offs_m[:, None] * CD + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc += tl.sum(f * x[None, :], 1)
            ss += x * x
        acc = tl.where(offs_m == MP - 1, tl.sum(ss, 0), acc)
        tl.store(part_ptr + (s * B + b) * MP + offs_m, acc, mask=(offs_m * 0 + b) < B)


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
def _reciprocal(s, INTERP: tl.constexpr):
    """1 / s by the hardware's approximate reciprocal (one MUFU instruction, within 1 ulp; a division
    under the interpreter, which runs no PTX): note "comb apart"."""
    if INTERP:
        return 1.0 / s
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _norm4(a, b, c, d, eps, INTERP: tl.constexpr):
    """(a, b, c, d) / (a + b + c + d + eps): one Sinkhorn normalisation of a row or column."""
    r = _reciprocal((a + b) + (c + d) + eps, INTERP)
    return a * r, b * r, c * r, d * r


@triton.jit
def _softmax4(ptr, at, eps):
    """softmax of the 4 logits at ptr[at : at + 4], + eps (the Sinkhorn's first row step)."""
    a = tl.load(ptr + at)
    b = tl.load(ptr + at + 1)
    c = tl.load(ptr + at + 2)
    d = tl.load(ptr + at + 3)
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    s = (a + b) + (c + d)
    return a / s + eps, b / s + eps, c / s + eps, d / s + eps


@triton.jit
def _store4(ptr, at, a, b, c, d):
    tl.store(ptr + at, a)
    tl.store(ptr + at + 1, b)
    tl.store(ptr + at + 2, c)
    tl.store(ptr + at + 3, d)


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
    nw_ptr,
    norm_eps,
    y_blocks,
    MP: tl.constexpr,
    S_PAD: tl.constexpr,
    C_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRE: tl.constexpr,
    C4: tl.constexpr,
    NORM: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
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
        if pid_d == y_blocks:  # the program after the row's y blocks (note "comb apart")
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
            if C4:
                # C = 4 (V4-Flash): the 16 entries as scalars, which every thread holds and
                # updates alone: no cross-thread reduction in the 2 x iters normalisations
                # (the tensor form's shuffles made this loop the kernel's latency).
                comb_rows = comb_ptr + b * 16
                tl.store(comb_rows + offs_c[:, None] * 4 + offs_c[None, :], logits)
                tl.debug_barrier()  # the stores above are read back as scalars by every thread
                m00, m01, m02, m03 = _softmax4(comb_rows, 0, hc_eps)
                m10, m11, m12, m13 = _softmax4(comb_rows, 4, hc_eps)
                m20, m21, m22, m23 = _softmax4(comb_rows, 8, hc_eps)
                m30, m31, m32, m33 = _softmax4(comb_rows, 12, hc_eps)
                m00, m10, m20, m30 = _norm4(m00, m10, m20, m30, hc_eps, INTERP)
                m01, m11, m21, m31 = _norm4(m01, m11, m21, m31, hc_eps, INTERP)
                m02, m12, m22, m32 = _norm4(m02, m12, m22, m32, hc_eps, INTERP)
                m03, m13, m23, m33 = _norm4(m03, m13, m23, m33, hc_eps, INTERP)
                for _ in range(1, iters):
                    m00, m01, m02, m03 = _norm4(m00, m01, m02, m03, hc_eps, INTERP)
                    m10, m11, m12, m13 = _norm4(m10, m11, m12, m13, hc_eps, INTERP)
                    m20, m21, m22, m23 = _norm4(m20, m21, m22, m23, hc_eps, INTERP)
                    m30, m31, m32, m33 = _norm4(m30, m31, m32, m33, hc_eps, INTERP)
                    m00, m10, m20, m30 = _norm4(m00, m10, m20, m30, hc_eps, INTERP)
                    m01, m11, m21, m31 = _norm4(m01, m11, m21, m31, hc_eps, INTERP)
                    m02, m12, m22, m32 = _norm4(m02, m12, m22, m32, hc_eps, INTERP)
                    m03, m13, m23, m33 = _norm4(m03, m13, m23, m33, hc_eps, INTERP)
                tl.debug_barrier()  # every thread has read the logits before they are overwritten
                _store4(comb_rows, 0, m00, m01, m02, m03)
                _store4(comb_rows, 4, m10, m11, m12, m13)
                _store4(comb_rows, 8, m20, m21, m22, m23)
                _store4(comb_rows, 12, m30, m31, m32, m33)
            else:
                logits = tl.where(valid, logits, float("-inf"))
                e = tl.exp(logits - tl.max(logits, 1)[:, None])
                mat = tl.where(valid, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)  # row softmax + eps
                mat = mat / (tl.sum(mat, 0)[None, :] + hc_eps)  # column normalisation
                for _ in range(1, iters):
                    mat = mat / (tl.sum(mat, 1)[:, None] + hc_eps)
                    mat = mat / (tl.sum(mat, 0)[None, :] + hc_eps)
                tl.store(comb_ptr + b * C * C + offs_c[:, None] * C + offs_c[None, :], mat, mask=valid)

    if pid_d < y_blocks:  # the y programs (hc_pre's one after them made post and comb above)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        xs = tl.load(
            x_ptr + b.to(tl.int64) * stride_xb + offs_c[:, None] * D + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        y = tl.sum(w[:, None] * xs.to(tl.float32), 0)
        y_row = y_ptr + b.to(tl.int64) * stride_yb
        tl.store(y_row + offs_d, y.to(y_ptr.dtype.element_ty), mask=d_mask)
        if NORM:  # the whole row is this program's (note "norm in the finish"): y read back, normed in place
            tl.debug_barrier()  # every thread's y stored before any thread reads the row
            norm_row(y_row, nw_ptr, y_row, D, norm_eps, BLOCK_D)


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


def _mix_and_finish(X, fn, base, scale, y, post, comb, attrs, workspace, pre: bool, norm_w=None) -> None:
    b, c, d = X.shape
    m = fn.shape[0]
    mp = _mix_pad(m)
    split, per = _split(c * d)
    (part,) = carve(workspace, X.device, _parts(b, c * d, m))
    rows = min(MIX_ROWS, b)
    _hc_mix_kernel[(split, triton.cdiv(b, rows))](
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
        ROWS=rows,
        num_warps=4,
        **pdl_args(X.device),
    )
    norm = norm_w is not None
    block_d = next_pow2(d) if norm else min(FINISH_BLOCK_D, next_pow2(d))
    y_blocks = triton.cdiv(d, block_d)
    _hc_finish_kernel[(b, y_blocks + pre)](
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
        norm_w if norm else y,
        float(attrs["norm_eps"]) if norm else 0.0,
        y_blocks,
        MP=mp,
        S_PAD=next_pow2(split),
        C_PAD=next_pow2(c),
        BLOCK_D=block_d,
        PRE=pre,
        C4=c == 4,
        NORM=norm,
        INTERP=interpreting(),
        num_warps=NORM_WARPS if norm else FINISH_WARPS,
        **pdl_args(X.device),
    )


def hc_pre_impl(inputs, outputs, attrs, workspace):
    X, fn, base, scale = inputs
    y, post, comb = outputs
    if not _usable(X, (fn, base, scale, post, comb)) or y.stride(1) != 1:
        from draftgraph.ops.mhc import _hc_pre_impl

        return _hc_pre_impl(inputs, outputs, attrs, workspace)
    _mix_and_finish(X, fn, base, scale, y, post, comb, attrs, workspace, pre=True)


def hc_pre_norm_impl(inputs, outputs, attrs, workspace):
    """hc_pre with its norm in the finish (note "norm in the finish"); the torch op where the
    kernels do not apply, and hc_pre's kernels then the norm's past NORM_MAX_D."""
    X, fn, base, scale, norm_w = inputs
    y, post, comb = outputs
    if not _usable(X, (fn, base, scale, post, comb, norm_w)) or y.stride(1) != 1:
        from draftgraph.ops.mhc import _hc_pre_norm_impl

        return _hc_pre_norm_impl(inputs, outputs, attrs, workspace)
    if X.shape[2] > NORM_MAX_D:
        _mix_and_finish(X, fn, base, scale, y, post, comb, attrs, workspace, pre=True)
        rms_norm_rows(y, norm_w, float(attrs["norm_eps"]), y)
        return
    _mix_and_finish(X, fn, base, scale, y, post, comb, attrs, workspace, pre=True, norm_w=norm_w)


def hc_head_impl(inputs, outputs, attrs, workspace):
    X, fn, base, scale = inputs
    (y,) = outputs
    if not _usable(X, (fn, base, scale)) or y.stride(1) != 1:
        from draftgraph.ops.mhc import _hc_head_impl

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
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
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
        from draftgraph.ops.mhc import _hc_post_impl

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
        **pdl_args(X.device),
    )
