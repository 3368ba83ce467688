"""FP8 block-scaled skinny GEMM for 2 <= B <= 64 on the tensor cores: ``mma.sync`` on decoded words.

out[B, N] = x[B, K] @ dequant(W)[N, K]^T with W e4m3 and one UE8M0 scale per 128 x 128 block, as
``fp8_linear.fp8_gemv``, whose dot tiles move every decoded tile through shared memory into
``tl.dot`` (35% of copy bandwidth at B=4 on an H200, the 4096 x 4096 linear). Here each lane
decodes its own FP8 words straight into the A fragments of ``mma.sync.m16n8k16`` (bf16, fp32
accumulate) and loads the activation of its own batch column as B, as ``moe_mxfp4_mma`` does for
the MXFP4 experts: no shared memory, no barrier, one decode for 8 batch rows (more rows: another
pass over the words, from L2).

Note "lanes and fragments": a warp holds 16 weight rows. Lane (g, t) (g = lane / 4, t = lane % 4)
reads rows g and g + 8 of its warp's 16, columns 16t .. 16t + 15 of each 64-column chunk (16 bytes
a row: one ``ld.v4`` of 4 words), and the activation of batch column g over the same 16 columns
(two ``ld.v4`` of bf16 pairs). Word i of each row (4 codes: pairs (4i, 4i + 1) and (4i + 2,
4i + 3)) is A of the i-th of 4 mmas, the activation pairs 2i and 2i + 1 its B; the mma sums over k
slots, so the order in which lanes cover the columns does not matter as long as A and B use the
same one. Both rows lie in one 128-row scale block (16-row warps from a multiple of 16), and the 16
columns in one 128-column block: one scale a lane a chunk. C's fragments are rows (g, g + 8) x
batch columns (2t, 2t + 1): each lane stores its four results.

Note "e4m3 by bits" (``FP8_MMA_PTX``): a code s eeee mmm placed as the bf16 bits s at 15 and
eeee mmm at 10..4 is its value times 2^-120 (exponent 0: a bf16 subnormal, exact), so one bf16x2
multiply by 2^120 gives two values exactly, a second one times the block scale (a power of two).
Per pair of codes: a byte permute (the two codes to the high bytes of the halves), a shift and
two masks, the two multiplies: about 3 instructions a code. The code 0x7F / 0xFF (NaN in e4m3,
never in a quantised checkpoint) decodes as 480, not NaN. ``tests/test_e2m1_ptx.py`` runs the PTX
text up to the mmas on a model of its instructions for every byte.

Every tensor in the loop has one element a thread (1D, 32 x warps), and every load and store
there is inline PTX (``lanes``), so the element a lane holds is the one its index says. Under the
interpreter, which runs no PTX, the mma is computed from the same per-lane fragments
(``_mma_twin``): the lane mapping, the loads' addresses and the stores are the GPU's.

Options as ``fp8_gemv``'s, where this path takes them: PRO_NORM (x normed per row, rounded to bf16
as the bf16 norm is: each pass's 8 rows' inverse RMS by scalar reductions, so the lane tensors keep
their layout), GROUPED (wo_a), TWO_W (wq_a + wkv). Not here (``fp8_gemv`` keeps the dot tiles for
them): split-K, accumulate, fp16 x.
"""

from __future__ import annotations

import triton
import triton.language as tl
from draftgraph.ops.triton._common import pdl_wait
from draftgraph.ops.triton.lanes import bf16_hi, bf16_lo, lane_pick, lane_store, ld_u8, ld_v4, quad_sum


def _pair_lines(word: str, j: int, scale: str, out: str) -> str:
    """PTX: codes 2j and 2j + 1 of ``word`` as a bf16x2 pair (column 2j low) times ``scale``."""
    return "\n".join([
        f"prmt.b32 t, {word}, 0, 0x{2 * j + 1}4{2 * j}4;",  # code 2j to bits 8..15, code 2j + 1 to 24..31
        "shr.u32 u, t, 4;",
        "and.b32 u, u, 0x07F007F0;",  # eeee mmm to bits 10..4 of each half
        "and.b32 t, t, 0x80008000;",  # the sign to bit 15
        "or.b32 t, t, u;",
        "fma.rn.bf16x2 t, t, r, z;",  # times 2^120: the codes' values, exactly
        f"fma.rn.bf16x2 {out}, t, {scale}, z;",  # times the block scale (a power of two: exact)
    ])  # fmt: skip


def _mma_ptx() -> str:
    # $4..$7: row g's 4 words; $8..$11: row g + 8's; $12: their block scale as bf16x2; $13..$20: the
    # activation's pairs 0..7 of the same 16 columns; $21..$24: C in; $0..$3: C out.
    lines = ["{", ".reg .b32 t, u, r, z, a0, a1, b0, b1;", "mov.b32 r, 0x7B807B80;", "mov.b32 z, 0x80008000;"]
    for i in range(4):
        for j, (reg, out) in enumerate(((f"${4 + i}", "a0"), (f"${4 + i}", "a1"), (f"${8 + i}", "b0"),
                                        (f"${8 + i}", "b1"))):  # fmt: skip
            lines.append(_pair_lines(reg, j % 2, "$12", out))
        c_in = "{$21, $22, $23, $24}" if i == 0 else "{$0, $1, $2, $3}"
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{a0, b0, a1, b1}}, "
                     f"{{${13 + 2 * i}, ${14 + 2 * i}}}, {c_in};")  # fmt: skip
    return "\n".join(lines + ["}"])


FP8_MMA_PTX = tl.constexpr(_mma_ptx())


@triton.jit
def _scale_pair(s):
    """UE8M0 bytes (int32) -> 2^(byte - 127) as bf16 in both halves (byte 0: 2^-127, a bf16
    subnormal; 255: NaN)."""
    bits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7))
    return bits | bits << 16


@triton.jit
def _e4m3_f32(c):
    """e4m3 codes (int32 0..255) -> fp32 as FP8_MMA_PTX decodes them (0x7F / 0xFF: 480, see "e4m3 by bits")."""
    mag = ((c & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # the bits times 2^120
    return tl.where(c >= 128, -mag, mag)


@triton.jit
def _mma_twin(c0, c1, c2, c3, wa, wb, s, x, t, W: tl.constexpr):
    """FP8_MMA_PTX by arithmetic (the interpreter): the same C fragments from the same lanes' words.
    wa / wb: the two rows' 4 words; s: the scale byte; x: the 8 activation pairs."""
    f = tl.where(s == 255, float("nan"), (tl.maximum(s, 1) << 23).to(tl.float32, bitcast=True))
    f = tl.where(s == 0, 5.877471754111438e-39, f)  # 2^-127
    top = tl.zeros([W, 8, 8], dtype=tl.float32)
    bot = tl.zeros([W, 8, 8], dtype=tl.float32)
    for i in tl.static_range(4):
        for j in tl.static_range(4):
            if j % 2 == 0:
                xv = bf16_lo(x[2 * i + j // 2])
            else:
                xv = bf16_hi(x[2 * i + j // 2])
            top += quad_sum(_e4m3_f32(wa[i] >> 8 * j & 255) * f, xv, W)
            bot += quad_sum(_e4m3_f32(wb[i] >> 8 * j & 255) * f, xv, W)
    return (c0 + lane_pick(top, t, 0, W), c1 + lane_pick(top, t, 1, W),
            c2 + lane_pick(bot, t, 0, W), c3 + lane_pick(bot, t, 1, W))  # fmt: skip


@triton.jit
def _mma_chunk(c0, c1, c2, c3, wa, wb, s, x, t, W: tl.constexpr, INTERP: tl.constexpr):
    """C += a lane's 16 columns of rows g and g + 8 (words wa / wb, scale byte s) times the activation pairs x."""
    if INTERP:
        return _mma_twin(c0, c1, c2, c3, wa, wb, s, x, t, W)
    else:
        return tl.inline_asm_elementwise(
            FP8_MMA_PTX, "=f,=f,=f,=f," + "r," * 17 + "f,f,f,f",
            [wa[0], wa[1], wa[2], wa[3], wb[0], wb[1], wb[2], wb[3], _scale_pair(s),
             x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], c0, c1, c2, c3],
            dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _bf16_pair(lo, hi):
    """Two fp32 values rounded to bf16, as one int32 pair (lo in the low half)."""
    lo_bits = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo_bits | hi_bits << 16


@triton.jit
def _normed(p, n, inv):
    """An activation pair p times the lane's inverse RMS and the norm weight's pair n, rounded to bf16."""
    return _bf16_pair(bf16_lo(p) * inv * bf16_lo(n), bf16_hi(p) * inv * bf16_hi(n))


@triton.jit
def _pairs16(ptr, INTERP: tl.constexpr):
    """The 8 bf16 pairs (16 columns) at each lane's pointer (int32, 16-byte aligned): two ld.v4."""
    p0, p1, p2, p3 = ld_v4(ptr, INTERP)
    p4, p5, p6, p7 = ld_v4(ptr + 4, INTERP)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _row_inv(x_ptr, stride_xb, r, B, K, eps, K_PAD: tl.constexpr):
    """1 / RMS of x row r (0 past B), a scalar: every lane gets it without a layout change."""
    cols = tl.arange(0, K_PAD)
    live = (cols < K) & (cols * 0 + r < B)
    v = tl.load(x_ptr + r * stride_xb + cols, mask=live, other=0.0).to(tl.float32)  # B <= 64 rows
    return 1.0 / tl.sqrt(tl.sum(v * v, 0) / K + eps)


@triton.jit
def _fp8_mma_kernel(
    x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, nw_ptr, out_ptr,
    B, N, N_A, K, stride_xb, stride_wn, stride_sn, stride_w2n, stride_s2n, stride_ob, group_rows, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PAD: tl.constexpr, EVEN_K: tl.constexpr,
    GROUPED: tl.constexpr, TWO_W: tl.constexpr, PRO_NORM: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    W: tl.constexpr = BLOCK_N // 16
    pid_n = tl.program_id(0)
    n0 = pid_n * BLOCK_N
    tid = tl.arange(0, 2 * BLOCK_N)  # 32 lanes a warp, 16 rows a warp
    g = tid % 32 // 4
    t = tid % 4
    row = n0 + tid // 32 * 16 + g  # rows row and row + 8 of out
    mat_w = w_ptr
    mat_s = s_ptr
    row_w = stride_wn
    row_s = stride_sn
    first = 0
    n_rows = N_A
    if TWO_W:
        if n0 >= N_A:  # a program's rows lie in one matrix (the host checks BLOCK_N divides N_A)
            mat_w = w2_ptr
            mat_s = s2_ptr
            row_w = stride_w2n
            row_s = stride_s2n
            first = N_A
            n_rows = N - N_A
    local_g = tl.minimum(row - first, n_rows - 1).to(tl.int64)  # rows past the end read the last row, unstored
    local_g8 = tl.minimum(row + 8 - first, n_rows - 1).to(tl.int64)
    words = mat_w.to(tl.pointer_type(tl.int32), bitcast=True)
    w_g = words + local_g * (row_w // 4)
    w_g8 = words + local_g8 * (row_w // 4)
    s_row = mat_s + (local_g // 128) * row_s  # rows g and g + 8: one 128-row scale block
    x_col0 = 0
    if GROUPED:
        x_col0 = (n0 // group_rows) * K
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    n_words = nw_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pdl_wait(PDL)
    for r0 in range(0, B, 8):  # 8 batch rows (the mma's n) a pass; a later pass reads the words again (L2)
        col_b = tl.minimum(r0 + g, B - 1)  # B's column g: a column past B reads a real row, never stored
        a_row = x_words + (col_b.to(tl.int64) * stride_xb + x_col0) // 2
        inv = g * 0.0
        if PRO_NORM:
            for j in tl.static_range(8):
                inv = tl.where(g == j, _row_inv(x_ptr, stride_xb, r0 + j, B, K, eps, K_PAD), inv)
        zero = g * 0.0
        c0, c1, c2, c3 = zero, zero, zero, zero
        for k0 in range(0, K, BLOCK_K):
            for c in tl.static_range(BLOCK_K // 64):
                col = k0 + c * 64 + 16 * t  # this lane's 16 columns
                live = col < K
                if not EVEN_K:
                    col = tl.minimum(col, K - 16)  # a chunk past K reads a real address, masked below
                wa = ld_v4(w_g + col // 4, INTERP)
                wb = ld_v4(w_g8 + col // 4, INTERP)
                s = ld_u8(s_row + col // 128, INTERP)
                x = _pairs16(a_row + col // 2, INTERP)
                if PRO_NORM:
                    nw = _pairs16(n_words + col // 2, INTERP)
                    x = (_normed(x[0], nw[0], inv), _normed(x[1], nw[1], inv), _normed(x[2], nw[2], inv),
                         _normed(x[3], nw[3], inv), _normed(x[4], nw[4], inv), _normed(x[5], nw[5], inv),
                         _normed(x[6], nw[6], inv), _normed(x[7], nw[7], inv))  # fmt: skip
                if not EVEN_K:  # zero activations and a finite scale: a masked chunk adds exactly 0
                    x = (tl.where(live, x[0], 0), tl.where(live, x[1], 0), tl.where(live, x[2], 0),
                         tl.where(live, x[3], 0), tl.where(live, x[4], 0), tl.where(live, x[5], 0),
                         tl.where(live, x[6], 0), tl.where(live, x[7], 0))  # fmt: skip
                    s = tl.where(live, s, 127)
                c0, c1, c2, c3 = _mma_chunk(c0, c1, c2, c3, wa, wb, s, x, t, W, INTERP)
        col0 = r0 + 2 * t  # C's columns 2t and 2t + 1: batch rows
        out0 = out_ptr + col0.to(tl.int64) * stride_ob
        out1 = out0 + stride_ob
        real_g = row < N
        real_g8 = row + 8 < N
        lane_store(out0 + row, c0, real_g & (col0 < B), INTERP)
        lane_store(out1 + row, c1, real_g & (col0 + 1 < B), INTERP)
        lane_store(out0 + row + 8, c2, real_g8 & (col0 < B), INTERP)
        lane_store(out1 + row + 8, c3, real_g8 & (col0 + 1 < B), INTERP)


def launch(grid, *args, **meta):
    _fp8_mma_kernel[grid](*args, **meta)


__all__ = ["FP8_MMA_PTX", "launch"]
