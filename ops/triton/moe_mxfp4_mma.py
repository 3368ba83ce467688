"""Expert-major MXFP4 MoE for B > 1 on the tensor cores: ``mma.sync`` on the decoded words.

At a few rows an expert, an FMA kernel pays its decode and one FMA a row for every code on CUDA
cores (``moe_mxfp4_rows``, 45f7cd2 to 04300e5: 366.6 us for the MoE at B=4 on an H100, against
241.4 here), and the dot tiles (``_expert_tiles``) move the decoded tile through shared memory
into ``tl.dot``. Here each lane decodes its own words straight into the A fragments
of ``mma.sync.m16n8k16`` (bf16, fp32 accumulate) and loads the activation of its own batch column
straight into the B fragment: no shared memory, no barrier, and one decode serves the 8 rows that
chose the expert of a batch tile (the mma's n), or past 8 rows a batch the 16 of two tiles (note
"chunks of 16"; more rows: another program, the words read and decoded again).

Note "lanes and fragments": a warp holds 16 weight rows. Lane (g, t) (g = lane / 4, t = lane % 4)
reads rows g and g + 8 of its warp's 16, block t of each 4 consecutive 32-column scale blocks (16
bytes a row: one ``ld.v4`` of 4 words), and the activation of batch column g (the g-th row that
chose the expert) over the same 32 columns. One word of each row (8 codes, as bf16x2 pairs 0..3
times its block scale) is A of 2 mmas (pairs 0, 1 at k slots 2t, 2t + 1 and 2t + 8, 2t + 9; then
pairs 2, 3); the activation's pairs of the same word are B. The mma sums over k slots, so the
order in which lanes cover the columns does not matter as long as A and B use the same one. The
fragments of C are rows (g, g + 8) x columns (2t, 2t + 1): each lane stores its four results.

Every tensor in the loop has one element a thread (1D, 32 x warps: Triton's layout puts element i
on thread i), and every load and store there is inline PTX (no layout anchor that could move an
element to another thread), so the element a lane holds is the one its index says. The lanes'
rows and columns are read from the expert-row table (``_table_columns``), not found by reductions
over a tensor of another layout.

Note "expert-row table": a launch before w13 (``_expert_rows_kernel``, one program a routed slot)
splits each expert's rows into chunks of CHUNK rows (8, the mma's n, or 16: note "chunks of 16"), in
row order, and gives each
chunk to a slot of its own: the first pair of the chunk's first row (a row picks an expert at most
once as a slot; a repeat pair of the same row heads nothing). That slot's row of the table holds the
chunk's rows: each row's index, its act row (the first k that chose the expert) and its summed
routing weight, and their count (0 for a slot that heads no chunk). Every w13 / w2 program reads
its slot's count, and for its one pass three words a lane. Before (e901c32), each program found
its rows by scalar loads of the whole routing, B x top_k of them a pass, in all (N / BLOCK_N) x B x
top_k programs of both kernels: at B=32, 192 loads and selects a lane a pass against a w2 pass of
16 K tiles, and w2 (half the bytes of w13) took longer than w13 in the chain's profile. Until
this change the table gave all of an expert's rows to its first slot, whose program ran one pass
per 8 rows, one after the other, while the slots of the expert's other pairs had nothing to do:
an expert 20 rows chose took three passes' time in one program at the end of the launch.

Note "chunks of 16": a chunk's program decodes every word of its expert's rows (two matrices of
2048 x 4096 codes for w13), whatever its rows; a chunk costs ~5 us of its program's chain of loads,
decodes and mmas, whether its words come from L2 or HBM (benchmarks/h200/KERNEL_RUNS.md, "Eleventh device runs"),
so at B=32 (~23 experts, ~36 chunks of 8) w13 and w2 paid ~36 decodes of an expert for ~23 distinct
ones. Past 8 rows a batch (``mma_chunk_rows``) the table cuts chunks of 16, and a program whose chunk
has more than 8 rows runs its pass on two batch tiles (``_mma_pass2``): each word is decoded once
into A and multiplied by both tiles' activations (``MMA_WORD2_PTX``: four mmas a word where one tile
takes two), so an expert of 9..16 rows costs one decode, not two. A chunk of at most 8 rows takes the
one-tile pass (a program-uniform branch): its loads and mmas are as before.

Note "shared expert first": the grid's second axis runs from the last slot to the first, so the
shared expert's programs (its last slot) are dispatched first. Each runs all of K for 64 rows on
the dot tiles (w13: two FP8 matrices of 4096 columns, 64 dependent K tiles), the longest chain of
loads in the launch; dispatched last (until this change), they ran after the routed programs had
drained, in a tail the routed work could not hide.

Note "split K": w13's K is cut into SPLIT parts (``W13_SPLIT_MMA``), each a program of its own
(axis 0: row tile x part). A w13 program reads two matrices over all of K, four times a w2
program's bytes, so far fewer programs than w2 carry the same bytes: at B=8 with 23 experts
about 760 of them, 1.2 waves of the ~660 an H100 holds at once, where the second, partial wave
ran alone (w13 took 2.6x w2's time for 2x its bytes; the shared expert's 32 programs, each 512 KB,
the longest). Split, each part stores its fp32 partials of w1 x and w3 x (act-row-major, a plane
a part) and counts its arrival on the tile's counter (a barrier, then one acq_rel atomic: the
others' stores are visible to whoever counts last); the last to arrive sums the parts' partials
in part order (the same sums whichever comes last: deterministic) and stores the act rows as an
unsplit program does. The counters are zeroed by the expert-row table's launch, which runs
before w13 in the same op; the partials live in the op's scratch. Four parts (the default) took
w13 at B=8 from 208 to 186 us (random routing) and 120 to 98 (23 experts) on an H100; eight
lost at B=32 (benchmarks/h200/KERNEL_RUNS.md, "Eighth device runs").

Note "rebiased scale": a code's bits placed as a bf16 (``_decode_lines``) are its value times
2^-126, so the decode multiplies each pair by 2^126 and then by the block scale 2^(byte - 127): two
bf16x2 multiplies of the ~4.75 instructions a pair. Where every scale byte of the matrix is at most
``REBIAS_MAX_SCALE_BYTE`` (128: a block scale up to 2, as quantised weights have: e2m1 reaches 6), one
multiply by 2^(byte - 1) does both, with the same result bit for bit (a power of two times the
exact code; the product is the one rounding either way). The fused op asks its bound weights
(``QuantWeight.max_scale_byte``: one device read, kept on the weight; a direct ``moe_mxfp4`` call
reads the scales, ``rebias_fits``) and passes REBIASED; a matrix with a larger scale keeps the two
multiplies, as does a capture that finds a weight not yet read. Under the interpreter both are the
twin. Measured: the MoE is not bound by its decode (B=32 -6 us; benchmarks/h200/KERNEL_RUNS.md, "Tenth device runs").

The shared expert (FP8, every row) takes the dot tiles (``_shared_w13_dot``, ``_shared_w2_dot``).
Scratch, partials and the reduce are ``moe_mxfp4``'s expert-major ones. Under the interpreter,
which runs no PTX, the mma is computed by ``_mma_twin`` from the same per-lane fragments (the lane
mapping, gathers and stores are the ones the GPU runs; only the mma and the loads differ).
"""

from __future__ import annotations

import triton
import triton.language as tl
from draftgraph.ops.triton._common import clamped_swiglu, last_to_arrive, pdl_wait
from draftgraph.ops.triton.fp8_linear import ue8m0_to_f32
from draftgraph.ops.triton.lanes import (
    bf16_hi,
    bf16_lo,
    lane_pick,
    lane_store,
    ld_b32,
    ld_b32_shared,
    ld_u8,
    ld_v4,
    quad_sum,
)
from draftgraph.ops.triton.moe_grouped import expert_hits
from draftgraph.ops.triton.moe_mxfp4 import (
    MMA_ROWS,
    _expert_tiles,
    _word_block,
    ue8m0_bf16_bits,
)

MMA_N = tl.constexpr(MMA_ROWS)  # a pass's rows (the mma's n), the rows of a table chunk


def _decode_lines(word: str, scale: str, outs: tuple[str, ...], rebiased: bool) -> str:
    """PTX: the 4 bf16x2 pairs of ``word`` (moe_mxfp4's note "e2m1 by bits") times ``scale``; with
    ``rebiased`` the scale holds the 2^126 too (note "rebiased scale"): one multiply a pair."""
    lines = [f"and.b32 lo, {word}, 0x0F0F0F0F;", f"shr.u32 hi, {word}, 4;", "and.b32 hi, hi, 0x0F0F0F0F;"]
    for j, out in enumerate(outs):
        lines += [f"prmt.b32 t, lo, hi, 0x8{4 + j}8{j};", "mul.lo.u32 t, t, 0x1040;", "and.b32 t, t, 0x81C081C0;"]
        if not rebiased:
            lines.append("fma.rn.bf16x2 t, t, r, z;")  # times 2^126: the codes' values, exactly
        lines.append(f"fma.rn.bf16x2 {out}, t, {scale}, z;")  # times the block scale (a power of two: exact)
    return "\n".join(lines)


def _mma_word_ptx(rebiased: bool, tiles: int = 1) -> str:
    """One word of rows g and g + 8 decoded once and multiplied by ``tiles`` batch tiles' activations
    (note "chunks of 16"). With T = tiles: $0..$(4T - 1): C out (tile 0's four, then tile 1's);
    $(4T) / $(4T + 1): a word of row g / g + 8; $(4T + 2) / $(4T + 3): their block scales as bf16x2
    (times 2^126 when ``rebiased``); then each tile's activation pairs 0..3 of the same 8 columns; then
    C in, in C out's order (see "lanes and fragments")."""
    word, x0 = 4 * tiles, 4 * tiles + 4
    c_in = x0 + 4 * tiles
    lines = ["{", ".reg .b32 lo, hi, t, r, z, a0, a1, a2, a3, b0, b1, b2, b3;", "mov.b32 r, 0x7E807E80;",
             "mov.b32 z, 0x80008000;", _decode_lines(f"${word}", f"${word + 2}", ("a0", "a1", "a2", "a3"), rebiased),
             _decode_lines(f"${word + 1}", f"${word + 3}", ("b0", "b1", "b2", "b3"), rebiased)]
    for half, a in enumerate(("{a0, b0, a1, b1}", "{a2, b2, a3, b3}")):  # pairs 0, 1 of the word, then 2, 3
        for j in range(tiles):
            out = ", ".join(f"${4 * j + i}" for i in range(4))
            acc = ", ".join(f"${c_in + 4 * j + i}" for i in range(4)) if half == 0 else out
            x = f"${x0 + 4 * j + 2 * half}, ${x0 + 4 * j + 2 * half + 1}"
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{out}}}, {a}, {{{x}}}, {{{acc}}};")
    return "\n".join(lines) + "\n}"


def _mma_word_operands(tiles: int) -> str:
    """The constraints of ``_mma_word_ptx(..., tiles)``: C out; the words, scales and activations; C in."""
    return ",".join(["=f"] * (4 * tiles) + ["r"] * (4 + 4 * tiles) + ["f"] * (4 * tiles))


MMA_WORD_PTX = tl.constexpr(_mma_word_ptx(False))
MMA_WORD_REBIASED_PTX = tl.constexpr(_mma_word_ptx(True))
MMA_WORD_OPERANDS = tl.constexpr(_mma_word_operands(1))
MMA_WORD2_PTX = tl.constexpr(_mma_word_ptx(False, 2))
MMA_WORD2_REBIASED_PTX = tl.constexpr(_mma_word_ptx(True, 2))
MMA_WORD2_OPERANDS = tl.constexpr(_mma_word_operands(2))


@triton.jit
def _scale_pair(s, REBIASED: tl.constexpr):
    """UE8M0 bytes (int32) -> 2^(byte - 127) as bf16 in both halves (moe_mxfp4._scale_bf16's bits);
    REBIASED: 2^(byte - 1), the scale times 2^126 (bytes up to REBIAS_MAX_SCALE_BYTE; 255 stays NaN)."""
    if REBIASED:
        b = s.to(tl.int32)
        bits = tl.where(b == 255, 0x7FC0, (b + 126) << 7)
    else:
        bits = ue8m0_bf16_bits(s)
    return bits | bits << 16


@triton.jit
def _code_value(w, J: tl.constexpr):
    """Code J (bits 4J .. 4J + 3) of int32 words ``w`` as fp32, exactly (the interpreter's decode,
    fewer steps than e2m1_to_f32: every MMA test's time on CPU is mostly this). The code's bits put
    where a float's go (sign at 31, e1 e0 at exponent bits 24..23, m at mantissa bit 22) are its value
    times 2^-126, as in "e2m1 by bits" (e = 0: an fp32 subnormal, which numpy keeps), so one multiply
    by 2^126 gives the value."""
    if J <= 5:
        mag = (w << (22 - 4 * J)) & 0x01C00000
    else:
        mag = (w >> (4 * J - 22)) & 0x01C00000
    sign = (w << (28 - 4 * J)) & -2147483648
    return (mag | sign).to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _word_values(w, s):
    """The 8 codes of words ``w`` (code j: columns j of 8) times their scale bytes ``s``, fp32 (the
    interpreter's decode)."""
    f = ue8m0_to_f32(s)
    return (_code_value(w, 0) * f, _code_value(w, 1) * f, _code_value(w, 2) * f, _code_value(w, 3) * f,
            _code_value(w, 4) * f, _code_value(w, 5) * f, _code_value(w, 6) * f, _code_value(w, 7) * f)  # fmt: skip


@triton.jit
def _mma_twin(c0, c1, c2, c3, wa, wb, sa, sb, x0, x1, x2, x3, t, W: tl.constexpr):
    """MMA_WORD_PTX by arithmetic (the interpreter): the same C fragments from the same lanes' words."""
    va = _word_values(wa, sa)
    vb = _word_values(wb, sb)
    xs = (bf16_lo(x0), bf16_hi(x0), bf16_lo(x1), bf16_hi(x1), bf16_lo(x2), bf16_hi(x2), bf16_lo(x3), bf16_hi(x3))
    top = quad_sum(va[0], xs[0], W)
    bot = quad_sum(vb[0], xs[0], W)
    for j in tl.static_range(1, 8):
        top += quad_sum(va[j], xs[j], W)
        bot += quad_sum(vb[j], xs[j], W)
    return (c0 + lane_pick(top, t, 0, W), c1 + lane_pick(top, t, 1, W),
            c2 + lane_pick(bot, t, 0, W), c3 + lane_pick(bot, t, 1, W))  # fmt: skip


@triton.jit
def _mma_word(c0, c1, c2, c3, wa, wb, sa, sb, x0, x1, x2, x3, t, W: tl.constexpr, REBIASED: tl.constexpr,
              INTERP: tl.constexpr):  # fmt: skip
    """C += one word of rows g and g + 8 (UE8M0 bytes sa / sb) times the activation pairs x0..x3."""
    if INTERP:  # the values by arithmetic: the same with either decode
        return _mma_twin(c0, c1, c2, c3, wa, wb, sa, sb, x0, x1, x2, x3, t, W)
    elif REBIASED:
        return tl.inline_asm_elementwise(MMA_WORD_REBIASED_PTX, MMA_WORD_OPERANDS,
                                         [wa, wb, _scale_pair(sa, True), _scale_pair(sb, True), x0, x1, x2, x3,
                                          c0, c1, c2, c3],
                                         dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(MMA_WORD_PTX, MMA_WORD_OPERANDS,
                                         [wa, wb, _scale_pair(sa, False), _scale_pair(sb, False), x0, x1, x2, x3,
                                          c0, c1, c2, c3],
                                         dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _block_words(w_g, w_g8, s_g, s_g8, bt, live, EVEN: tl.constexpr, INTERP: tl.constexpr):
    """A lane's block ``bt`` of its two rows: the 4 words of each (word pointers w_g / w_g8) and their
    scale bytes (s_g / s_g8). ``live``: the block is real; a clamped one's scale reads as byte 0
    (finite: its products with the zero activation are 0, even where the real byte is 255, NaN)."""
    a0, a1, a2, a3 = ld_v4(w_g + bt * 4, INTERP)
    b0, b1, b2, b3 = ld_v4(w_g8 + bt * 4, INTERP)
    sa = ld_u8(s_g + bt, INTERP)
    sb = ld_u8(s_g8 + bt, INTERP)
    if not EVEN:
        sa = tl.where(live, sa, 0)
        sb = tl.where(live, sb, 0)
    return a0, a1, a2, a3, b0, b1, b2, b3, sa, sb


@triton.jit
def _mma_block(c0, c1, c2, c3, w_g, w_g8, s_g, s_g8, bt, live, x, t, W: tl.constexpr, EVEN: tl.constexpr,
               REBIASED: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """C += a lane's block ``bt`` of its two rows (``_block_words``) times the activation words x (16:
    the block's 32 columns, from ``_act_block``, 0 where the block is not real)."""
    a0, a1, a2, a3, b0, b1, b2, b3, sa, sb = _block_words(w_g, w_g8, s_g, s_g8, bt, live, EVEN, INTERP)
    c0, c1, c2, c3 = _mma_word(c0, c1, c2, c3, a0, b0, sa, sb, x[0], x[1], x[2], x[3], t, W, REBIASED, INTERP)
    c0, c1, c2, c3 = _mma_word(c0, c1, c2, c3, a1, b1, sa, sb, x[4], x[5], x[6], x[7], t, W, REBIASED, INTERP)
    c0, c1, c2, c3 = _mma_word(c0, c1, c2, c3, a2, b2, sa, sb, x[8], x[9], x[10], x[11], t, W, REBIASED, INTERP)
    c0, c1, c2, c3 = _mma_word(c0, c1, c2, c3, a3, b3, sa, sb, x[12], x[13], x[14], x[15], t, W, REBIASED, INTERP)
    return c0, c1, c2, c3


@triton.jit
def _mma_rows(c0, c1, c2, c3, w_ptr, s_ptr, base_g, base_g8, K, bt, live, x, t, W: tl.constexpr, EVEN: tl.constexpr,
              REBIASED: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """``_mma_block`` on rows base_g and base_g8 (row indices into the stacked [E * N, K] matrix) of
    the MXFP4 bytes at w_ptr, scales at s_ptr."""
    words = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    return _mma_block(c0, c1, c2, c3, words + base_g * (K // 8), words + base_g8 * (K // 8), s_ptr + base_g * (K // 32),
                      s_ptr + base_g8 * (K // 32), bt, live, x, t, W, EVEN, REBIASED, INTERP)  # fmt: skip


@triton.jit
def _act_block(a_row, bt, live, EVEN: tl.constexpr, INTERP: tl.constexpr):
    """The 16 activation words (bf16 pairs) of block ``bt`` of a lane's row ``a_row``; 0 where the
    block is not real (none: EVEN). A batch column with no row reads a real row: C's column n
    depends on B's column n alone, and a dead column is never stored."""
    x0, x1, x2, x3 = ld_v4(a_row + bt * 16, INTERP)
    x4, x5, x6, x7 = ld_v4(a_row + bt * 16 + 4, INTERP)
    x8, x9, x10, x11 = ld_v4(a_row + bt * 16 + 8, INTERP)
    x12, x13, x14, x15 = ld_v4(a_row + bt * 16 + 12, INTERP)
    if EVEN:
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15
    return (tl.where(live, x0, 0), tl.where(live, x1, 0), tl.where(live, x2, 0), tl.where(live, x3, 0),
            tl.where(live, x4, 0), tl.where(live, x5, 0), tl.where(live, x6, 0), tl.where(live, x7, 0),
            tl.where(live, x8, 0), tl.where(live, x9, 0), tl.where(live, x10, 0), tl.where(live, x11, 0),
            tl.where(live, x12, 0), tl.where(live, x13, 0), tl.where(live, x14, 0), tl.where(live, x15, 0))  # fmt: skip


@triton.jit
def _mma_pass(a_row, wa_ptr, sa_ptr, wb_ptr, sb_ptr, base_g, base_g8, K, k_lo, k_hi, g, t, W: tl.constexpr,
              BLOCK_K: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr, REBIASED: tl.constexpr,
              INTERP: tl.constexpr):  # fmt: skip
    """One pass over columns k_lo .. k_hi of K (k_lo a multiple of BLOCK_K, k_hi - k_lo too unless k_hi
    is K): C of matrix a (and, with TWO, of matrix b: w1 and w3 in one loop, each activation block
    loaded once for both) for the lane's rows and batch column, from 0."""
    zero = g * 0.0
    c0, c1, c2, c3 = zero, zero, zero, zero
    d0, d1, d2, d3 = zero, zero, zero, zero
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for c in tl.static_range(BLOCK_K // 128):
            _, bt, live = _word_block(k0 + c * 128, t, 0, K, EVEN)  # this lane's block: t of 4
            x = _act_block(a_row, bt, live, EVEN, INTERP)
            c0, c1, c2, c3 = _mma_rows(c0, c1, c2, c3, wa_ptr, sa_ptr, base_g, base_g8, K, bt, live, x, t, W, EVEN,
                                       REBIASED, INTERP)  # fmt: skip
            if TWO:
                d0, d1, d2, d3 = _mma_rows(d0, d1, d2, d3, wb_ptr, sb_ptr, base_g, base_g8, K, bt, live, x, t, W, EVEN,
                                           REBIASED, INTERP)  # fmt: skip
    return c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _mma_word2(c, wa, wb, sa, sb, x, y, j: tl.constexpr, t, W: tl.constexpr, REBIASED: tl.constexpr,
               INTERP: tl.constexpr):  # fmt: skip
    """C (8: tile 0's four, tile 1's four) += one word (the j-th of the lane's 4) of rows g and g + 8
    times the activation pairs of tile 0 (``x``) and tile 1 (``y``): one decode for both tiles."""
    x0, x1, x2, x3 = x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]
    y0, y1, y2, y3 = y[4 * j], y[4 * j + 1], y[4 * j + 2], y[4 * j + 3]
    if INTERP:  # the values by arithmetic: each tile as the one-tile word
        c0, c1, c2, c3 = _mma_twin(c[0], c[1], c[2], c[3], wa, wb, sa, sb, x0, x1, x2, x3, t, W)
        c4, c5, c6, c7 = _mma_twin(c[4], c[5], c[6], c[7], wa, wb, sa, sb, y0, y1, y2, y3, t, W)
        return c0, c1, c2, c3, c4, c5, c6, c7
    elif REBIASED:
        return tl.inline_asm_elementwise(MMA_WORD2_REBIASED_PTX, MMA_WORD2_OPERANDS,
                                         [wa, wb, _scale_pair(sa, True), _scale_pair(sb, True), x0, x1, x2, x3,
                                          y0, y1, y2, y3, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(MMA_WORD2_PTX, MMA_WORD2_OPERANDS,
                                         [wa, wb, _scale_pair(sa, False), _scale_pair(sb, False), x0, x1, x2, x3,
                                          y0, y1, y2, y3, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _mma_rows2(c, w_ptr, s_ptr, base_g, base_g8, K, bt, live, x, y, t, W: tl.constexpr, EVEN: tl.constexpr,
               REBIASED: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """``_mma_rows`` on two batch tiles: C (8) += block ``bt`` of rows base_g / base_g8 times the
    activation blocks ``x`` (tile 0) and ``y`` (tile 1); the words and scales loaded once."""
    words = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    a0, a1, a2, a3, b0, b1, b2, b3, sa, sb = _block_words(words + base_g * (K // 8), words + base_g8 * (K // 8),
                                                          s_ptr + base_g * (K // 32), s_ptr + base_g8 * (K // 32),
                                                          bt, live, EVEN, INTERP)  # fmt: skip
    c = _mma_word2(c, a0, b0, sa, sb, x, y, 0, t, W, REBIASED, INTERP)
    c = _mma_word2(c, a1, b1, sa, sb, x, y, 1, t, W, REBIASED, INTERP)
    c = _mma_word2(c, a2, b2, sa, sb, x, y, 2, t, W, REBIASED, INTERP)
    return _mma_word2(c, a3, b3, sa, sb, x, y, 3, t, W, REBIASED, INTERP)


@triton.jit
def _mma_pass2(a_row, a_row2, wa_ptr, sa_ptr, wb_ptr, sb_ptr, base_g, base_g8, K, k_lo, k_hi, g, t, W: tl.constexpr,
               BLOCK_K: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr, REBIASED: tl.constexpr,
               INTERP: tl.constexpr):  # fmt: skip
    """``_mma_pass`` on two batch tiles (note "chunks of 16"): the activation rows ``a_row`` (the lane's
    batch column g of tile 0) and ``a_row2`` (of tile 1). Returns C of matrix a (tile 0's four, tile
    1's four) and of matrix b (with TWO; else zeros) in the same order."""
    zero = g * 0.0
    c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
    d0, d1, d2, d3, d4, d5, d6, d7 = zero, zero, zero, zero, zero, zero, zero, zero
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for c in tl.static_range(BLOCK_K // 128):
            _, bt, live = _word_block(k0 + c * 128, t, 0, K, EVEN)  # this lane's block: t of 4
            x = _act_block(a_row, bt, live, EVEN, INTERP)
            y = _act_block(a_row2, bt, live, EVEN, INTERP)
            c0, c1, c2, c3, c4, c5, c6, c7 = _mma_rows2((c0, c1, c2, c3, c4, c5, c6, c7), wa_ptr, sa_ptr, base_g,
                                                        base_g8, K, bt, live, x, y, t, W, EVEN, REBIASED,
                                                        INTERP)  # fmt: skip
            if TWO:
                d0, d1, d2, d3, d4, d5, d6, d7 = _mma_rows2((d0, d1, d2, d3, d4, d5, d6, d7), wb_ptr, sb_ptr, base_g,
                                                            base_g8, K, bt, live, x, y, t, W, EVEN, REBIASED,
                                                            INTERP)  # fmt: skip
    return c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7


@triton.jit
def _chunk_rows(idx_ptr, wts_ptr, slot, B, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                CHUNK: tl.constexpr):
    """Routed slot ``slot``'s chunk (see "expert-row table"): (serves [BLOCK_R]: the rows of the chunk
    the slot heads, none if it heads none; each row's place in the chunk, its summed routing weight
    and its act row)."""
    e = tl.load(idx_ptr + slot).to(tl.int64)
    rows, ks, flat, hit = expert_hits(idx_ptr, e, B, TOPK, TOPK_PAD, BLOCK_R)
    chose = tl.sum(hit.to(tl.int32), 1) > 0
    dest = rows * TOPK + tl.min(tl.where(hit, ks[None, :], TOPK_PAD), 1)  # the row's first pair with e
    rank = tl.cumsum(chose.to(tl.int32), 0) - 1  # among the rows that chose e, in row order
    mine = rows == slot // TOPK
    my_rank = tl.sum(tl.where(mine, rank, 0), 0)
    # A negative id (NO_EXPERT) heads nothing; nor does a repeat pair of a row (not its first).
    heads = (tl.sum(tl.where(mine, dest, 0), 0) == slot) & (my_rank % CHUNK == 0) & (e >= 0)
    place = rank - my_rank
    serves = chose & (place >= 0) & (place < CHUNK) & ((rows * 0 + heads.to(tl.int32)) != 0)  # a [BLOCK_R] mask
    weight = tl.sum(tl.load(wts_ptr + flat, mask=hit, other=0.0), 1)
    return serves, place, weight, dest


@triton.jit
def _expert_rows_kernel(idx_ptr, wts_ptr, count_ptr, rows_ptr, dest_ptr, wt_ptr, cnt_ptr, B, npid, TOPK: tl.constexpr,
                        TOPK_PAD: tl.constexpr, BLOCK_R: tl.constexpr, NPID_PAD: tl.constexpr, CHUNK: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
    """Routed slot s's row of the expert-row table (see "expert-row table"): count[s], and from
    s * MMA_ROWS on, the rows of the chunk it heads in row order, their act rows and weights; and
    the arrival counts of w13's tiles of the slot ("split K"), 0 (slot 0: the shared expert's too)."""
    pdl_wait(PDL)
    slot = tl.program_id(0)
    if NPID_PAD > 0:
        tiles = tl.arange(0, NPID_PAD)
        tl.store(cnt_ptr + slot * npid + tiles, tl.zeros_like(tiles), mask=tiles < npid)
        if slot == 0:
            tl.store(cnt_ptr + B * TOPK * npid + tiles, tl.zeros_like(tiles), mask=tiles < npid)
    serves, place, weight, dest = _chunk_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_R, CHUNK)
    at = slot * CHUNK + place
    tl.store(rows_ptr + at, tl.arange(0, BLOCK_R), mask=serves)
    tl.store(dest_ptr + at, dest.to(tl.int32), mask=serves)
    tl.store(wt_ptr + at, weight, mask=serves)
    tl.store(count_ptr + slot, tl.sum(serves.to(tl.int32), 0))


@triton.jit
def _table_columns(rows_ptr, dest_ptr, wt_ptr, base, n, g, t, INTERP: tl.constexpr):
    """The lane's columns of a batch tile (the table's entries base.., n rows of them, all 8 live when
    n >= 8): batch column g (B's): its x row and its act row; columns 2t and 2t + 1 (C's): the act /
    part row, the routing weight, whether live. A batch column with no row reads the tile's first (a
    real row: C's column n depends on B's column n alone, and a dead column is never stored)."""
    jb = base + tl.where(g < n, g, 0)
    j0 = 2 * t
    j1 = j0 + 1
    live0 = j0 < n
    live1 = j1 < n
    at0 = base + tl.where(live0, j0, 0)
    at1 = base + tl.where(live1, j1, 0)
    row_b = ld_b32(rows_ptr + jb, INTERP)
    dest_b = ld_b32(dest_ptr + jb, INTERP)
    dest0 = ld_b32(dest_ptr + at0, INTERP)
    dest1 = ld_b32(dest_ptr + at1, INTERP)
    wt0 = ld_b32(wt_ptr + at0, INTERP)
    wt1 = ld_b32(wt_ptr + at1, INTERP)
    return row_b, dest_b, dest0, wt0, live0, dest1, wt1, live1


@triton.jit
def _slot_lanes(idx_ptr, count_ptr, pid_n, slot, N, BLOCK_N: tl.constexpr):
    """A routed slot's program: (t, g, the lane's rows g and g + 8 (clamped into N) and whether each is
    real, the expert, the rows it serves (the table's count: 0 unless the slot heads a chunk), the two
    rows' indices in the stacked [E * N, K] matrix)."""
    tid = tl.arange(0, 2 * BLOCK_N)  # 32 lanes a warp, 16 rows a warp
    g = tid % 32 // 4
    t = tid % 4
    row = pid_n * BLOCK_N + tid // 32 * 16 + g
    row_g = tl.minimum(row, N - 1).to(tl.int64)
    row_g8 = tl.minimum(row + 8, N - 1).to(tl.int64)
    e = tl.load(idx_ptr + slot).to(tl.int64)
    n_served = tl.load(count_ptr + slot)
    first = tl.maximum(e, 0) * N
    return t, g, row_g, row_g8, row < N, row + 8 < N, e, n_served, first + row_g, first + row_g8


@triton.jit
def _shared_w13_dot(x_ptr, sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, act_ptr, split_ptr, cnt_ptr, pid_n, part, npid, B, D,
                   INTER, routed, stride_xb, stride_ssn, limit, k_lo, k_len, plane, BLOCK_N: tl.constexpr,
                   BLOCK_B: tl.constexpr, DOT_K: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr,
                   INTERP: tl.constexpr):  # fmt: skip
    """The shared expert's (FP8) act rows of every batch row, rows pid_n of its intermediate: the dot
    tiles, over columns k_lo .. k_lo + k_len (all of D unless split: "split K")."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    n64 = offs_n.to(tl.int64)
    all_rows = tl.arange(0, BLOCK_B)
    every = all_rows < B
    x_rows = x_ptr + all_rows.to(tl.int64)[:, None] * stride_xb + k_lo
    s_rows = (offs_n // 128) * stride_ssn + k_lo // 128
    g = _expert_tiles(x_rows, every, sw1_ptr + n64 * D + k_lo, ss1_ptr + s_rows, n_mask, k_len, k_len,
                      True, BLOCK_N, DOT_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    u = _expert_tiles(x_rows, every, sw3_ptr + n64 * D + k_lo, ss3_ptr + s_rows, n_mask, k_len, k_len,
                      True, BLOCK_N, DOT_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    at = (routed + all_rows).to(tl.int64)[None, :] * INTER + offs_n[:, None]
    mask = n_mask[:, None] & every[None, :]
    if SPLIT == 1:
        tl.store(act_ptr + at, clamped_swiglu(g, u, limit).to(act_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(split_ptr + part * plane + at, g, mask=mask)
        tl.store(split_ptr + part * plane + plane // 2 + at, u, mask=mask)
        if last_to_arrive(cnt_ptr + routed * npid + pid_n, SPLIT):
            g = tl.zeros_like(g)
            u = tl.zeros_like(u)
            for q in tl.static_range(SPLIT):  # in part order: the same sums whichever part came last
                g += tl.load(split_ptr + q * plane + at, mask=mask, other=0.0, volatile=True)
                u += tl.load(split_ptr + q * plane + plane // 2 + at, mask=mask, other=0.0,
                             volatile=True)  # fmt: skip
            tl.store(act_ptr + at, clamped_swiglu(g, u, limit).to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shared_w2_dot(act_ptr, sw2_ptr, ss2_ptr, part_ptr, pid_n, B, D, INTER, routed, stride_ssn, BLOCK_N: tl.constexpr,
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
def _store_lanes(out_ptr, INTER, dest0, live0, dest1, live1, row_g, row_g8, real_g, real_g8, v0, v1, v2, v3,
                 INTERP: tl.constexpr):  # fmt: skip
    """The lane's four values of C (rows g, g + 8 x columns 2t, 2t + 1) into act-row-major fp32 rows."""
    out0 = out_ptr + dest0.to(tl.int64) * INTER
    out1 = out_ptr + dest1.to(tl.int64) * INTER
    lane_store(out0 + row_g, v0, live0 & real_g, INTERP)
    lane_store(out1 + row_g, v1, live1 & real_g, INTERP)
    lane_store(out0 + row_g8, v2, live0 & real_g8, INTERP)
    lane_store(out1 + row_g8, v3, live1 & real_g8, INTERP)


@triton.jit
def _store_act(act_ptr, INTER, dest0, wt0, live0, dest1, wt1, live1, row_g, row_g8, real_g, real_g8, c0, c1, c2, c3,
               d0, d1, d2, d3, limit, INTERP: tl.constexpr):  # fmt: skip
    """The lane's four act values: SwiGLU (clamped) of w1 x and w3 x, times the row's routing weight."""
    _store_lanes(act_ptr, INTER, dest0, live0, dest1, live1, row_g, row_g8, real_g, real_g8,
                 clamped_swiglu(c0, d0, limit) * wt0, clamped_swiglu(c1, d1, limit) * wt1,
                 clamped_swiglu(c2, d2, limit) * wt0, clamped_swiglu(c3, d3, limit) * wt1, INTERP)  # fmt: skip


@triton.jit
def _split_sum(part_ptr, plane, INTER, dest0, dest1, row_g, row_g8, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """The lane's four w1 x and four w3 x summed over the SPLIT parts' partials, in part order."""
    p0 = part_ptr + dest0.to(tl.int64) * INTER
    p1 = part_ptr + dest1.to(tl.int64) * INTER
    zero = row_g * 0.0
    c0, c1, c2, c3 = zero, zero, zero, zero
    d0, d1, d2, d3 = zero, zero, zero, zero
    for q in tl.static_range(SPLIT):
        c0 += ld_b32_shared(p0 + q * plane + row_g, INTERP)
        c1 += ld_b32_shared(p1 + q * plane + row_g, INTERP)
        c2 += ld_b32_shared(p0 + q * plane + row_g8, INTERP)
        c3 += ld_b32_shared(p1 + q * plane + row_g8, INTERP)
        d0 += ld_b32_shared(p0 + q * plane + plane // 2 + row_g, INTERP)
        d1 += ld_b32_shared(p1 + q * plane + plane // 2 + row_g, INTERP)
        d2 += ld_b32_shared(p0 + q * plane + plane // 2 + row_g8, INTERP)
        d3 += ld_b32_shared(p1 + q * plane + plane // 2 + row_g8, INTERP)
    return c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _w13_out(act_ptr, split_ptr, cnt_ptr, part, plane, npid, pid_n, slot, INTER, limit, tile0, tile1, row_g, row_g8,
             real_g, real_g8, c, d, TILES: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """A routed program's act values: each batch tile's (``tile0`` / ``tile1``: its table columns from
    ``_table_columns``; C of w1 x in ``c``, of w3 x in ``d``, four a tile) SwiGLU times the routing
    weight; split, this part's partials, and the last part of the tile to arrive sums them."""
    _, _, dest0, wt0, live0, dest1, wt1, live1 = tile0
    _, _, dest2, wt2, live2, dest3, wt3, live3 = tile1
    if SPLIT == 1:
        _store_act(act_ptr, INTER, dest0, wt0, live0, dest1, wt1, live1, row_g, row_g8, real_g, real_g8,
                   c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3], limit, INTERP)  # fmt: skip
        if TILES == 2:
            _store_act(act_ptr, INTER, dest2, wt2, live2, dest3, wt3, live3, row_g, row_g8, real_g, real_g8,
                       c[4], c[5], c[6], c[7], d[4], d[5], d[6], d[7], limit, INTERP)  # fmt: skip
    else:  # this part's partials; the last part of the tile to finish sums them
        mine = split_ptr + part * plane
        _store_lanes(mine, INTER, dest0, live0, dest1, live1, row_g, row_g8, real_g, real_g8, c[0], c[1], c[2], c[3],
                     INTERP)  # fmt: skip
        _store_lanes(mine + plane // 2, INTER, dest0, live0, dest1, live1, row_g, row_g8, real_g, real_g8,
                     d[0], d[1], d[2], d[3], INTERP)  # fmt: skip
        if TILES == 2:
            _store_lanes(mine, INTER, dest2, live2, dest3, live3, row_g, row_g8, real_g, real_g8, c[4], c[5], c[6],
                         c[7], INTERP)  # fmt: skip
            _store_lanes(mine + plane // 2, INTER, dest2, live2, dest3, live3, row_g, row_g8, real_g, real_g8,
                         d[4], d[5], d[6], d[7], INTERP)  # fmt: skip
        if last_to_arrive(cnt_ptr + slot * npid + pid_n, SPLIT):
            c0, c1, c2, c3, d0, d1, d2, d3 = _split_sum(split_ptr, plane, INTER, dest0, dest1, row_g, row_g8, SPLIT,
                                                        INTERP)  # fmt: skip
            _store_act(act_ptr, INTER, dest0, wt0, live0, dest1, wt1, live1, row_g, row_g8, real_g, real_g8,
                       c0, c1, c2, c3, d0, d1, d2, d3, limit, INTERP)  # fmt: skip
            if TILES == 2:
                c4, c5, c6, c7, d4, d5, d6, d7 = _split_sum(split_ptr, plane, INTER, dest2, dest3, row_g, row_g8,
                                                            SPLIT, INTERP)  # fmt: skip
                _store_act(act_ptr, INTER, dest2, wt2, live2, dest3, wt3, live3, row_g, row_g8, real_g, real_g8,
                           c4, c5, c6, c7, d4, d5, d6, d7, limit, INTERP)  # fmt: skip


@triton.jit
def _w13_mma_kernel(
    x_ptr, idx_ptr, count_ptr, trows_ptr, tdest_ptr, twt_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, sw1_ptr, ss1_ptr,
    sw3_ptr, ss3_ptr, act_ptr, split_ptr, cnt_ptr,
    B, D, INTER, stride_xb, stride_ssn, limit, K_PART,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_K: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr,
    REBIASED: tl.constexpr, NATIVE: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid_n = tl.program_id(0) // SPLIT
    part = tl.program_id(0) % SPLIT  # the columns part * K_PART on ("split K"; all of D: SPLIT 1)
    npid = tl.num_programs(0) // SPLIT
    k_lo = part * K_PART
    k_hi = tl.minimum(k_lo + K_PART, D)
    slot = tl.num_programs(1) - 1 - tl.program_id(1)  # the shared expert's programs first ("shared expert first")
    routed = B * TOPK
    plane = 2 * (routed + B) * INTER  # a part's partials: w1 x, then w3 x, of every act row
    if slot >= routed:
        _shared_w13_dot(x_ptr, sw1_ptr, ss1_ptr, sw3_ptr, ss3_ptr, act_ptr, split_ptr, cnt_ptr, pid_n, part, npid, B,
                       D, INTER, routed, stride_xb, stride_ssn, limit, k_lo, k_hi - k_lo, plane, BLOCK_N, BLOCK_B,
                       DOT_K, SPLIT, NATIVE, INTERP)  # fmt: skip
    else:
        W: tl.constexpr = BLOCK_N // 16
        t, g, row_g, row_g8, real_g, real_g8, e, n_served, base_g, base_g8 = _slot_lanes(
            idx_ptr, count_ptr, pid_n, slot, INTER, BLOCK_N)
        x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if n_served > 0:
            tile0 = _table_columns(trows_ptr, tdest_ptr, twt_ptr, slot * CHUNK, n_served, g, t, INTERP)
            a_row = x_words + tile0[0].to(tl.int64) * (stride_xb // 2)
            if CHUNK > MMA_N and n_served > MMA_N:  # one pass on two batch tiles (note "chunks of 16")
                tile1 = _table_columns(trows_ptr, tdest_ptr, twt_ptr, slot * CHUNK + MMA_N, n_served - MMA_N, g, t,
                                       INTERP)  # fmt: skip
                out = _mma_pass2(a_row, x_words + tile1[0].to(tl.int64) * (stride_xb // 2), w1_ptr, s1_ptr, w3_ptr,
                                 s3_ptr, base_g, base_g8, D, k_lo, k_hi, g, t, W, BLOCK_K, True, EVEN, REBIASED,
                                 INTERP)  # fmt: skip
                _w13_out(act_ptr, split_ptr, cnt_ptr, part, plane, npid, pid_n, slot, INTER, limit, tile0, tile1,
                         row_g, row_g8, real_g, real_g8, (out[0], out[1], out[2], out[3], out[4], out[5], out[6],
                                                          out[7]),
                         (out[8], out[9], out[10], out[11], out[12], out[13], out[14], out[15]), 2, SPLIT,
                         INTERP)  # fmt: skip
            else:  # one pass on one tile: a chunk of at most 8 rows, the mma's n ("expert-row table")
                c0, c1, c2, c3, d0, d1, d2, d3 = _mma_pass(a_row, w1_ptr, s1_ptr, w3_ptr, s3_ptr, base_g, base_g8, D,
                                                           k_lo, k_hi, g, t, W, BLOCK_K, True, EVEN, REBIASED,
                                                           INTERP)  # fmt: skip
                _w13_out(act_ptr, split_ptr, cnt_ptr, part, plane, npid, pid_n, slot, INTER, limit, tile0, tile0,
                         row_g, row_g8, real_g, real_g8, (c0, c1, c2, c3), (d0, d1, d2, d3), 1, SPLIT,
                         INTERP)  # fmt: skip


@triton.jit
def _w2_mma_kernel(
    act_ptr, idx_ptr, count_ptr, trows_ptr, tdest_ptr, twt_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, part_ptr,
    B, D, INTER, stride_ssn,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_K: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr,
    REBIASED: tl.constexpr, NATIVE: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.num_programs(1) - 1 - tl.program_id(1)  # the shared expert's programs first ("shared expert first")
    routed = B * TOPK
    if slot >= routed:
        _shared_w2_dot(act_ptr, sw2_ptr, ss2_ptr, part_ptr, pid_n, B, D, INTER, routed, stride_ssn, BLOCK_N, BLOCK_B,
                      DOT_K, NATIVE, INTERP)  # fmt: skip
    else:
        W: tl.constexpr = BLOCK_N // 16
        t, g, row_g, row_g8, real_g, real_g8, e, n_served, base_g, base_g8 = _slot_lanes(
            idx_ptr, count_ptr, pid_n, slot, D, BLOCK_N)
        act_words = act_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if n_served > 0:
            _, dest_b, dest0, _, live0, dest1, _, live1 = _table_columns(trows_ptr, tdest_ptr, twt_ptr, slot * CHUNK,
                                                                         n_served, g, t, INTERP)  # fmt: skip
            a_row = act_words + dest_b.to(tl.int64) * (INTER // 2)
            if CHUNK > MMA_N and n_served > MMA_N:  # one pass on two batch tiles (note "chunks of 16")
                _, dest_b2, dest2, _, live2, dest3, _, live3 = _table_columns(
                    trows_ptr, tdest_ptr, twt_ptr, slot * CHUNK + MMA_N, n_served - MMA_N, g, t, INTERP)
                c0, c1, c2, c3, c4, c5, c6, c7, _, _, _, _, _, _, _, _ = _mma_pass2(
                    a_row, act_words + dest_b2.to(tl.int64) * (INTER // 2), w2_ptr, s2_ptr, w2_ptr, s2_ptr, base_g,
                    base_g8, INTER, 0, INTER, g, t, W, BLOCK_K, False, EVEN, REBIASED, INTERP)  # fmt: skip
                _store_lanes(part_ptr, D, dest2, live2, dest3, live3, row_g, row_g8, real_g, real_g8, c4, c5, c6, c7,
                             INTERP)  # fmt: skip
            else:  # one pass on one tile: a chunk of at most 8 rows ("expert-row table")
                c0, c1, c2, c3, _, _, _, _ = _mma_pass(a_row, w2_ptr, s2_ptr, w2_ptr, s2_ptr, base_g, base_g8, INTER,
                                                       0, INTER, g, t, W, BLOCK_K, False, EVEN, REBIASED,
                                                       INTERP)  # fmt: skip
            _store_lanes(part_ptr, D, dest0, live0, dest1, live1, row_g, row_g8, real_g, real_g8, c0, c1, c2, c3,
                         INTERP)  # fmt: skip


def launch_rows(grid, *args, **meta):
    _expert_rows_kernel[grid](*args, **meta)


def launch_w13(grid, *args, **meta):
    _w13_mma_kernel[grid](*args, **meta)


def launch_w2(grid, *args, **meta):
    _w2_mma_kernel[grid](*args, **meta)


__all__ = ["launch_rows", "launch_w13", "launch_w2"]
