"""swa_attention decode: six launches, each weight byte read once.

1. GEMV x @ [wq_a; wkv]^T -> raw [B, q_lora + d] fp32 (one launch for both matrices), or
   its partials over ``PROJ_SPLIT`` parts of K (note "split proj").
2. kv finish, grid (B,): the partials' sum, q_norm of qa (note "q norm here"), kv_norm,
   optional FP8 rounding of the non-rotary head, RoPE on the tail, and the cache write at
   the row's slot; a padded row (block-table -1 at its position) writes nothing. It runs
   before (3): every row writes before any row reads.
3. GEMV q = qn @ wq_b^T, fp32 out.
4. attention: the per-head weightless RMS norm and RoPE of q, then one online-softmax
   pass over the window's keys gathered through the block table, the sink seeded as the
   running max with weight exp(0) = 1 so it joins the denominator only; inverse RoPE of
   the output's tail; bf16 o [B, H*d]. Two cores (``ATTN_IMPL``): "dot", grid
   (B, H / DOT_BLOCK_H, parts), s = q K^T and o = p K on the tensor cores with q and p in
   bf16, each key tile read once for 16 heads, RoPE through a [.., 2] split of the rows (the
   default: 17 us against ~27 us on an H200), the window split over programs at small batch
   (note "split window"); "fma", grid (B, H), fp32 throughout, latents held as even/odd
   halves so the RoPE pairs are elementwise.
5. grouped GEMV z_g = wo_a[g] @ o_g (bf16, as the reference rounds z).
6. GEMV out = wo_b @ z.

Note "split window": at B=1 the dot core has H / 16 = 4 programs, each walking the 128 keys of
the window in four dependent steps on one SM (16 us of an H100's step). Flash-decoding style,
the window is cut into ``parts`` ranges of keys, a program each, until B x head blocks x parts
reaches ``ATTN_MIN_PROGRAMS`` (B=1: 4 parts, B=8: 2, B >= 16: none). Each part keeps its own
running max m, sum l and output acc (part 0 seeded with the sink, the others with m = -1e30:
finite, so a part with no valid key gives weights exp(-inf - -1e30) = 0, not NaN) and stores
them, fp32, in the op's scratch; the last of a head block's parts to finish (an arrival count,
as the MoE's split K: ``last_to_arrive``) merges them in part order, o = sum_j e^(m_j - M) acc_j /
sum_j e^(m_j - M) l_j, deterministic whichever part comes last. The counts are zeroed by the kv
finish launch, which runs before (2 -> 4 above): nothing persists between launches, no launch
is added.

Note "split proj": [wq_a; wkv] is 1536 rows, 48 programs of the 32-row dot tiles at B > 1 (192
of the batch-1 tiles): too few to keep an H100's memory busy (22.7 us at B=8 for 6.3 MB of FP8).
Each part of K is a program of its own writing fp32 partials; kv finish, a program a row that
reads the row anyway, sums them in part order and rounds as raw is stored. No launch added.

Note "q norm here": kv finish holds the row's qa, so it writes q_norm(qa) (bf16, rounded as the
norm's output is) for the wq_b GEMV, which before recomputed the norm as a prologue in each of
its 1024 programs, a pass over qa before its first weight tile (32.5 us at B=8 on an H100 for
33.5 MB).

Note "split wo": at B > 1 the FP8 wo_a and wo_b GEMVs take the dot tiles, 256 and 128 programs of
32 rows, each walking all of K (4096 and 8192 columns): wo_b about one program an SM. Each is cut
into ``WO_SPLIT`` parts of K, reduced by the tile's last part (``fp8_gemv``'s "split K, reduced");
their arrival counts sit beside attend's and kv finish zeroes them all (a share a program).

Native weights (issue 28.2): with all five linears FP8 QuantWeights the GEMVs are
``fp8_linear.fp8_gemv`` on the stored bytes and scales (the same launches and options), and
raw is bf16, as the reference rounds qa and kv (fp8_gemv reads bf16 activations). W8A8
(``attrs["activations"] == "fp8"``) rounds each GEMV's input through FP8 first: x, o per group
and z by a launch of ``fp8_round.fp8_round_rows`` beside the GEMV; q_norm(qa) by kv finish as it
writes it (``fp8_round.round_row``), or from 8 rows by wq_b's own kernel on the FP8 tensor cores
(``Q_W8A8_CORE_CONFIG``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from draftgraph.ops.quantised import is_quantised, w8a8_rounds
from draftgraph.ops.triton._common import (
    carve,
    interpreting,
    last_to_arrive,
    mma,
    next_pow2,
    pdl_args,
    pdl_wait,
    scratch_bytes,
    splat,
    zero_share,
)
from draftgraph.ops.triton.fp8_linear import config_for as fp8_config_for
from draftgraph.ops.triton.fp8_linear import project, split_tiles
from draftgraph.ops.triton.fp8_round import fp8_round_rows, round_row
from draftgraph.ops.triton.gemv import GemvConfig, norm_block

# Tuned on an H200 at V4-Flash shapes, batch 1 (benchmarks/h200/KERNEL_RUNS.md, "Device run 2");
# batch > 1 uses gemv.BATCHED.
PROJ_CONFIG = GemvConfig(8, 1024, 4, 3, use_dot=False)  # wq_a + wkv: 1536 x 4096
Q_CONFIG = GemvConfig(16, 1024, 4, 2, use_dot=False)  # wq_b: 32768 x 1024, q_norm prologue
# W8A8 from 8 rows: wq_b with its activations rounded in the kernel and multiplied on the FP8
# tensor cores (fp8_linear's note "W8A8 on the tensor cores"), on 128-row tiles. Alone on an H100
# (bench_w8a8_gemv.py, benchmarks/h200/w8a8_gemv_c2f4da8_h100_log.txt): 13.7 / 14.4 / 22.8 us at
# 8 / 32 / 64 rows against 17.2 / 26.6 / 39.4 for the bf16 dot tiles on rounded activations. The
# other FP8 linears (N = 4096 or less) were slower that way: too few 128-row tiles.
Q_W8A8_CORE_MIN_ROWS = 8
Q_W8A8_CORE_CONFIG = GemvConfig(128, 128, 8, 4)
WO_A_CONFIG = GemvConfig(8, 1024, 4, 3, use_dot=False)  # 8 x 1024 x 4096, grouped
WO_B_CONFIG = GemvConfig(8, 1024, 4, 3, use_dot=False)  # 4096 x 8192
ATTN_IMPL = "dot"  # "dot": DOT_BLOCK_H heads a program on tensor cores; "fma": one program per (row, head)
DOT_BLOCK_H = 16
DOT_BLOCK_W = 32  # keys per online-softmax step
DOT_WARPS = 8
DOT_STAGES = 2
WO_SPLIT = 4  # K parts of the FP8 wo_a and wo_b GEMVs at B > 1, summed by their last part ("split wo"); 1: none
PROJ_SPLIT = 4  # K parts of the wq_a + wkv GEMV, summed by kv finish ("split proj"); 1: none
ATTN_MIN_PROGRAMS = 64  # the dot core's window is split until B x head blocks x parts reaches this ("split window")
BLOCK_W = 8  # keys per step of the "fma" core
ATTN_WARPS = 4
FP8_MAX = 448.0

_INV_FREQ: dict = {}


def _inv_freq(rope_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The reference's fp32 inverse frequencies, computed once per (r, theta, device)."""
    key = (rope_dim, float(theta), str(device))
    if key not in _INV_FREQ:
        steps = torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim
        _INV_FREQ[key] = 1.0 / (theta**steps)
    return _INV_FREQ[key]


@triton.jit
def _row_slot(table_ptr, b, p, stride_tb, max_blocks, num_slots, BS: tl.constexpr):
    """(slot, alive) of position p of row b: the reference's _write_kv rule."""
    p_c = tl.maximum(p, 0)
    blk_idx = p_c // BS
    blk = tl.load(table_ptr + b * stride_tb + tl.minimum(blk_idx, max_blocks - 1)).to(tl.int64)
    slot = blk * BS + p_c % BS
    alive = (p >= 0) & (blk_idx < max_blocks) & (blk >= 0) & (slot < num_slots)
    return slot, alive


@triton.jit
def _window_keys(
    table_ptr,
    b,
    p,
    w0,
    lowest,
    alive,
    stride_tb,
    max_blocks,
    num_slots,
    BS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """(slot, valid) of the BLOCK_W keys from w0 on in row b's window ending at p: positions
    j = p - WINDOW + 1 + w0 ..; a key is valid in the table, from kv_start (``lowest``) to p, in a
    mapped block and the pool, and only while the row itself is alive."""
    j = p - WINDOW + 1 + w0 + tl.arange(0, BLOCK_W)  # [BLOCK_W] positions
    j_c = tl.maximum(j, 0)
    jb = j_c // BS
    in_table = (j >= 0) & (jb < max_blocks)
    blk = tl.load(table_ptr + b * stride_tb + tl.minimum(jb, max_blocks - 1), mask=in_table, other=-1)
    slot = blk.to(tl.int64) * BS + j_c % BS
    valid = in_table & (j >= lowest) & (j <= p) & (blk >= 0) & (slot < num_slots) & splat(alive, j)
    return slot, valid


@triton.jit
def _rope_pairs(ev, od, p, inv_freq_ptr, pair, N_PAIR0: tl.constexpr, sign: tl.constexpr):
    """Rotate pairs (ev[i], od[i]) with i >= N_PAIR0 by sign * p * inv_freq[i - N_PAIR0]."""
    rot = pair >= N_PAIR0
    f = tl.load(inv_freq_ptr + tl.where(rot, pair - N_PAIR0, 0), mask=rot, other=0.0)
    ang = p.to(tl.float32) * f
    c = tl.cos(ang)
    s = tl.sin(ang) * sign
    return tl.where(rot, ev * c - od * s, ev), tl.where(rot, ev * s + od * c, od)


@triton.jit
def _fp8_round(v, scale):
    """Round v / scale to float8 e4m3 (clamped to +-448, nearest-even) and scale back; v fp32."""
    t = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
    a = tl.abs(t)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # below 2^-6 the grid is the subnormal step 2^-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    q = a / step  # exact: step is a power of two
    fl = tl.floor(q)
    frac = q - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), fl + 1.0, fl)
    return tl.where(t < 0, -r, r) * step * scale


@triton.jit
def _pow2_ceil_log2(y):
    """2^ceil(log2 y) for normal y > 0, exactly (bit arithmetic, no log rounding)."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _raw_values(raw_ptr, part_ptr, at, mask, plane, SPLIT: tl.constexpr):
    """fp32 values of raw at offsets ``at``: loaded, or under a split projection ("split proj") its
    partials summed in part order and rounded as raw would have been stored."""
    if SPLIT == 1:
        return tl.load(raw_ptr + at, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(part_ptr + at, mask=mask, other=0.0)
        for j in tl.static_range(1, SPLIT):
            v += tl.load(part_ptr + j * plane + at, mask=mask, other=0.0)
        return v.to(raw_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _kv_finish_kernel(
    raw_ptr,
    proj_part_ptr,
    norm_ptr,
    q_norm_ptr,
    qn_ptr,
    cache_ptr,
    table_ptr,
    pos_ptr,
    inv_freq_ptr,
    cnt_ptr,
    row_len,
    q_lora,
    stride_qn,
    stride_cs,
    stride_tb,
    stride_pb,
    max_blocks,
    num_slots,
    n_cnt,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    N_PAIR0: tl.constexpr,
    BS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_PAIRS: tl.constexpr,
    QA_BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    CNT_BLOCK: tl.constexpr,
    ROUND_QN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    if CNT_BLOCK > 0:  # this program's share of the op's arrival counts ("split window", "split wo")
        zero_share(cnt_ptr, n_cnt, b, CNT_BLOCK)
    row0 = b.to(tl.int64) * row_len
    plane = tl.num_programs(0).to(tl.int64) * row_len
    # q_norm(qa) for the wq_b GEMV ("q norm here"), rounded as the norm's bf16 output is.
    qo = tl.arange(0, QA_BLOCK)
    qm = qo < q_lora
    qa = _raw_values(raw_ptr, proj_part_ptr, row0 + qo, qm, plane, SPLIT)
    q_inv = 1.0 / tl.sqrt(tl.sum(qa * qa, 0) / q_lora + eps)
    qn = (qa * q_inv * tl.load(q_norm_ptr + qo, mask=qm, other=0.0).to(tl.float32)).to(qn_ptr.dtype.element_ty)
    if ROUND_QN:  # W8A8: wq_b's input rounded through FP8 here (QA_BLOCK >= 128), not by a launch of its own
        qn = round_row(qn.to(tl.float32), QA_BLOCK).to(qn_ptr.dtype.element_ty)
    tl.store(qn_ptr + b.to(tl.int64) * stride_qn + qo, qn, mask=qm)

    p = tl.load(pos_ptr + b * stride_pb)
    slot, alive = _row_slot(table_ptr, b, p, stride_tb, max_blocks, num_slots, BS)
    pair = tl.arange(0, HALF)
    every = pair < HALF
    kv0 = row0 + q_lora
    ev = _raw_values(raw_ptr, proj_part_ptr, kv0 + 2 * pair, every, plane, SPLIT)  # raw: fp32, or bf16 (FP8)
    od = _raw_values(raw_ptr, proj_part_ptr, kv0 + 2 * pair + 1, every, plane, SPLIT)
    inv = 1.0 / tl.sqrt((tl.sum(ev * ev, 0) + tl.sum(od * od, 0)) / HEAD_DIM + eps)
    ev = ev * inv * tl.load(norm_ptr + 2 * pair).to(tl.float32)
    od = od * inv * tl.load(norm_ptr + 2 * pair + 1).to(tl.float32)
    if FP8:
        # Blocks of 64 values = FP8_PAIRS pairs over the non-rotary head (pairs < N_PAIR0).
        amag = tl.where(pair < N_PAIR0, tl.maximum(tl.abs(ev), tl.abs(od)), 0.0)  # zero-padded as the reference
        blk_max = tl.max(tl.reshape(amag, [HALF // FP8_PAIRS, FP8_PAIRS]), 1)  # [HALF / FP8_PAIRS]
        blk_max = tl.reshape(tl.broadcast_to(blk_max[:, None], [HALF // FP8_PAIRS, FP8_PAIRS]), [HALF])
        scale = _pow2_ceil_log2(tl.maximum(blk_max, 1e-4) / 448.0)
        head = pair < N_PAIR0
        ev = tl.where(head, _fp8_round(ev, scale), ev)
        od = tl.where(head, _fp8_round(od, scale), od)
    ev, od = _rope_pairs(ev, od, p, inv_freq_ptr, pair, N_PAIR0, 1.0)
    row = cache_ptr + slot * stride_cs
    live = splat(alive, pair)
    tl.store(row + 2 * pair, ev.to(cache_ptr.dtype.element_ty), mask=live)
    tl.store(row + 2 * pair + 1, od.to(cache_ptr.dtype.element_ty), mask=live)


@triton.jit
def _swa_decode_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    pos_ptr,
    kv_start_ptr,
    sink_ptr,
    inv_freq_ptr,
    o_ptr,
    stride_qb,
    stride_cs,
    stride_tb,
    stride_ob,
    stride_pb,
    stride_kb,
    max_blocks,
    num_slots,
    eps,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    N_PAIR0: tl.constexpr,
    BS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + b * stride_pb)
    _, alive = _row_slot(table_ptr, b, p, stride_tb, max_blocks, num_slots, BS)
    lowest = tl.maximum(tl.load(kv_start_ptr + b * stride_kb), 0).to(tl.int64)
    pair = tl.arange(0, HALF)

    q_row = q_ptr + b.to(tl.int64) * stride_qb + h * HEAD_DIM
    qe = tl.load(q_row + 2 * pair).to(tl.float32)
    qo = tl.load(q_row + 2 * pair + 1).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(qe * qe, 0) + tl.sum(qo * qo, 0)) / HEAD_DIM + eps)
    qe, qo = _rope_pairs(qe * inv, qo * inv, p, inv_freq_ptr, pair, N_PAIR0, 1.0)

    sink = tl.load(sink_ptr + h)
    m_i = sink  # the sink seeds the running max with weight exp(sink - m_i) = 1
    l_i = sink * 0.0 + 1.0
    oe = tl.zeros([HALF], dtype=tl.float32)
    oo = tl.zeros([HALF], dtype=tl.float32)
    for w0 in range(0, WINDOW, BLOCK_W):
        slot, valid = _window_keys(
            table_ptr, b, p, w0, lowest, alive, stride_tb, max_blocks, num_slots, BS, WINDOW, BLOCK_W
        )
        key = cache_ptr + tl.where(valid, slot, 0)[:, None] * stride_cs + 2 * pair[None, :]
        ke = tl.load(key, mask=valid[:, None], other=0.0).to(tl.float32)
        ko = tl.load(key + 1, mask=valid[:, None], other=0.0).to(tl.float32)
        s = (tl.sum(ke * qe[None, :], 1) + tl.sum(ko * qo[None, :], 1)) * sm_scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        pw = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(pw, 0)
        oe = oe * alpha + tl.sum(pw[:, None] * ke, 0)
        oo = oo * alpha + tl.sum(pw[:, None] * ko, 0)
        m_i = m_new
    oe, od = _rope_pairs(oe / l_i, oo / l_i, p, inv_freq_ptr, pair, N_PAIR0, -1.0)
    o_row = o_ptr + b.to(tl.int64) * stride_ob + h * HEAD_DIM
    tl.store(o_row + 2 * pair, oe.to(o_ptr.dtype.element_ty))
    tl.store(o_row + 2 * pair + 1, od.to(o_ptr.dtype.element_ty))


@triton.jit
def _rotate_rows(
    x, p, inv_freq_ptr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, N_PAIR0: tl.constexpr, sign: tl.constexpr
):
    """Interleaved RoPE of x [ROWS, HEAD_DIM] (pairs >= N_PAIR0) by sign * p, via a [.., 2] split."""
    ev, od = tl.split(tl.reshape(x, [ROWS, HEAD_DIM // 2, 2]))
    pair = tl.arange(0, HEAD_DIM // 2)[None, :]
    ev, od = _rope_pairs(ev, od, p, inv_freq_ptr, pair, N_PAIR0, sign)
    return tl.reshape(tl.join(ev, od), [ROWS, HEAD_DIM])


@triton.jit
def _swa_decode_dot_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    pos_ptr,
    kv_start_ptr,
    sink_ptr,
    inv_freq_ptr,
    o_ptr,
    part_ptr,
    cnt_ptr,
    stride_qb,
    stride_cs,
    stride_tb,
    stride_ob,
    stride_pb,
    stride_kb,
    H,
    max_blocks,
    num_slots,
    eps,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    N_PAIR0: tl.constexpr,
    BS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PARTS: tl.constexpr,
    PART_KEYS: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_H heads of one row on the tensor cores: s = q K^T, o = p K; each key tile read once.

    q (head-normed, rotated, scaled by 1/sqrt(d)) and p enter the dots in bf16; the output's
    inverse RoPE is applied once after the loop. Program (b, head block, part) walks the keys
    part * PART_KEYS .. + PART_KEYS of the window (all of it when PARTS is 1: "split window").
    """
    pdl_wait(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    part = tl.program_id(2)
    h_local = tl.arange(0, BLOCK_H)
    heads = hb * BLOCK_H + h_local
    h_mask = heads < H
    p = tl.load(pos_ptr + b * stride_pb)
    _, alive = _row_slot(table_ptr, b, p, stride_tb, max_blocks, num_slots, BS)
    lowest = tl.maximum(tl.load(kv_start_ptr + b * stride_kb), 0).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * HEAD_DIM
    q = tl.load(q_rows + dims[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(q * q, 1) / HEAD_DIM + eps)  # [BLOCK_H]
    q = _rotate_rows(q * (inv * sm_scale)[:, None], p, inv_freq_ptr, BLOCK_H, HEAD_DIM, N_PAIR0, 1.0)
    qb = q.to(cache_ptr.dtype.element_ty)

    sink = tl.load(sink_ptr + heads, mask=h_mask, other=0.0)
    first = splat(part == 0, sink)
    m_i = tl.where(first, sink, -1e30)  # the sink seeds part 0's running max; -1e30: see "split window"
    l_i = tl.where(first, 1.0, 0.0)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for w0 in range(part * PART_KEYS, part * PART_KEYS + PART_KEYS, BLOCK_W):
        slot, valid = _window_keys(
            table_ptr, b, p, w0, lowest, alive, stride_tb, max_blocks, num_slots, BS, WINDOW, BLOCK_W
        )
        key = cache_ptr + tl.where(valid, slot, 0)[:, None] * stride_cs + dims[None, :]
        k = tl.load(key, mask=valid[:, None], other=0.0)  # [BLOCK_W, HEAD_DIM]
        s = mma(qb, tl.trans(k), INTERP)  # [BLOCK_H, BLOCK_W]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pw = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pw, 1)
        acc = acc * alpha[:, None] + mma(pw.to(k.dtype), k, INTERP)
        m_i = m_new
    o_rows = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * HEAD_DIM + dims[None, :]
    if PARTS == 1:
        o = _rotate_rows(acc / l_i[:, None], p, inv_freq_ptr, BLOCK_H, HEAD_DIM, N_PAIR0, -1.0)
        tl.store(o_rows, o.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        # This part's (acc, m, l), then the merge by the head block's last part to finish.
        tile = b.to(tl.int64) * tl.num_programs(1) + hb
        size = BLOCK_H * (HEAD_DIM + 2)
        mine = part_ptr + (tile * PARTS + part) * size
        tl.store(mine + h_local[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(mine + BLOCK_H * HEAD_DIM + h_local, m_i)
        tl.store(mine + BLOCK_H * HEAD_DIM + BLOCK_H + h_local, l_i)
        if last_to_arrive(cnt_ptr + tile, PARTS):
            parts = part_ptr + tile * PARTS * size
            m_all = tl.full([BLOCK_H], -1e30, tl.float32)
            for j in tl.static_range(PARTS):
                m_all = tl.maximum(m_all, tl.load(parts + j * size + BLOCK_H * HEAD_DIM + h_local, volatile=True))
            acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(PARTS):  # in part order: the same sums whichever part came last
                w = tl.exp(tl.load(parts + j * size + BLOCK_H * HEAD_DIM + h_local, volatile=True) - m_all)
                l_i += w * tl.load(parts + j * size + BLOCK_H * HEAD_DIM + BLOCK_H + h_local, volatile=True)
                acc += w[:, None] * tl.load(parts + j * size + h_local[:, None] * HEAD_DIM + dims[None, :],
                                            volatile=True)  # fmt: skip
            o = _rotate_rows(acc / l_i[:, None], p, inv_freq_ptr, BLOCK_H, HEAD_DIM, N_PAIR0, -1.0)
            tl.store(o_rows, o.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])


def window_parts(batch: int, heads: int, window: int) -> int:
    """Parts of the window the dot core splits over programs at this batch ("split window"); 1: none."""
    if ATTN_IMPL != "dot":
        return 1
    head_blocks = -(-heads // min(DOT_BLOCK_H, max(16, next_pow2(heads))))
    steps = -(-window // _dot_block_w(window))
    parts = 1
    while steps % (2 * parts) == 0 and batch * head_blocks * parts < ATTN_MIN_PROGRAMS:
        parts *= 2
    return parts


def proj_split_for(k: int) -> int:
    """K parts of the wq_a + wkv GEMV ("split proj"): PROJ_SPLIT, halved until K splits into 16-column tiles."""
    split = max(int(PROJ_SPLIT), 1)
    while split > 1 and k % (split * 16):
        split //= 2
    return split


def _dot_block_w(window: int) -> int:
    return min(DOT_BLOCK_W, max(16, next_pow2(window)))


def _parts(b: int, attrs, q_lora: int, x_dim: int, dtype: torch.dtype, quant: bool):
    h, d = int(attrs["num_heads"]), int(attrs["head_dim"])
    groups, o_lora = int(attrs["o_groups"]), int(attrs["o_lora_rank"])
    parts = window_parts(b, h, int(attrs["window"]))
    block_h = min(DOT_BLOCK_H, max(16, next_pow2(h)))
    tiles = b * -(-h // block_h) if parts > 1 else 0
    split = proj_split_for(int(x_dim))
    wo_split, wo_tiles = _wo_split(b, h * d, groups, o_lora, int(x_dim), quant)
    wo_rows = max(groups * o_lora, int(x_dim)) if wo_split > 1 else 0
    return [
        ((b, q_lora + d), dtype if quant else torch.float32),  # raw qa | kv (bf16 out of fp8_gemv)
        ((split if split > 1 else 0, b, q_lora + d), torch.float32),  # its partials ("split proj")
        ((b, q_lora), dtype),  # q_norm(qa), the wq_b GEMV's input
        ((b, h * d), torch.float32),  # raw q
        ((b, h * d), dtype),  # attention output o
        ((b, groups * o_lora), dtype),  # z
        ((tiles * parts, block_h * (d + 2)), torch.float32),  # each part's (acc, m, l): "split window"
        ((wo_split * b * wo_rows,), torch.float32),  # wo_a's, then wo_b's K partials ("split wo")
        ((tiles + sum(wo_tiles),), torch.int32),  # the arrival counts of both splits, zeroed by kv finish
    ]


def _wo_split(b: int, hd: int, groups: int, o_lora: int, dim: int, quant: bool) -> tuple[int, tuple[int, int]]:
    """(K parts, (wo_a's tiles, wo_b's tiles)) of wo_a and wo_b at this batch ("split wo"); 1 part: none."""
    split = max(int(WO_SPLIT), 1) if quant and b > 1 else 1
    if split == 1:
        return 1, (0, 0)
    cfg_a, cfg_b = fp8_config_for(b, groups * o_lora, split), fp8_config_for(b, dim, split)  # as project picks them
    return split, (split_tiles(b, groups * o_lora, groups * o_lora, hd // groups, cfg_a, False, o_lora, split),
                   split_tiles(b, dim, dim, groups * o_lora, cfg_b, False, 0, split))  # fmt: skip


def attention_workspace(specs, attrs, batch: int) -> int:
    """Scratch bytes of swa_attention at a concrete batch."""
    x, wq_a = specs[0], specs[1]
    return scratch_bytes(_parts(batch, attrs, wq_a.shape[0], x.shape[1], x.dtype, wq_a.is_quantised))


def _usable(inputs, attrs) -> bool:
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache, positions, kv_start, table = inputs
    d, r = int(attrs["head_dim"]), int(attrs["rope_dim"])
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1:
        return False
    if d & (d - 1) or (d - r) % 2 or r % 2:
        return False  # the kernels hold a latent as two power-of-two halves
    if attrs.get("kv_fp8_round", False) and d % 64:
        return False
    linears = (wq_a, wq_b, wkv, wo_a, wo_b)
    if any(map(is_quantised, linears)) and _mixed(linears):
        return False  # see attention_block_scaled
    # Metadata are strided views of the packed per-row buffer (kv_metadata): positions and
    # kv_start by their row stride, the block table by rows; only its entries must be dense.
    dense = [t for w in inputs[1:10] for t in ((w.data, w.scale) if is_quantised(w) else (w,))]
    return table.stride(1) == 1 and all(t.is_contiguous() for t in dense)


def _mixed(linears) -> bool:
    return not all(is_quantised(w) and w.fmt == "fp8" for w in linears)


def attention_block_scaled(specs) -> str | None:
    """Why the fused attention cannot read these block-scaled linears, or None (all five FP8)."""
    quants = [specs[i].quant for i in (1, 3, 4, 6, 7)]
    if all(q == "fp8" for q in quants):
        return None
    return f"the fused attention reads its five linears all FP8 or all bf16, got {quants}"


def plan(inputs, outputs, attrs, workspace) -> list[tuple[str, callable]]:
    """The launches of one call, as (name, thunk); the impl runs them in order."""
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache, positions, kv_start, table = inputs
    h, d, r = int(attrs["num_heads"]), int(attrs["head_dim"]), int(attrs["rope_dim"])
    groups = int(attrs["o_groups"])
    o_lora = wo_a.shape[0] // groups
    eps, theta = float(attrs["eps"]), float(attrs["rope_theta"])
    bs, window = int(attrs.get("block_size", 16)), int(attrs["window"])
    b, q_lora, n = x.shape[0], wq_a.shape[0], d - r
    quant = is_quantised(wq_a)  # then all five are FP8 (_usable)
    w8a8 = w8a8_rounds(wq_a, attrs)
    q_on_cores = w8a8 and b >= Q_W8A8_CORE_MIN_ROWS  # wq_b rounds qn in the kernel, on the FP8 tensor cores
    scratch = _parts(b, attrs, q_lora, x.shape[1], x.dtype, quant)
    raw, proj_parts, qn, q, o, z, window_partials, wo_parts, arrivals = carve(workspace, x.device, scratch)
    parts, proj_split = window_parts(b, h, window), max(proj_parts.shape[0], 1)
    wo_split, (tiles_a, tiles_b) = _wo_split(b, h * d, groups, o_lora, x.shape[1], quant)
    attend_tiles = arrivals.numel() - tiles_a - tiles_b
    cnt_share = triton.cdiv(arrivals.numel(), b)
    inv_freq = _inv_freq(r, theta, x.device)
    num_slots, max_blocks = cache.shape[0], table.shape[1]

    def w8a8_in(t: torch.Tensor) -> torch.Tensor:
        return fp8_round_rows(t) if w8a8 else t

    def proj_():  # raw = x @ [wq_a; wkv]^T, or its K split's partials ("split proj")
        if proj_split > 1:
            project(w8a8_in(x), wq_a, proj_parts, w2=wkv, config=PROJ_CONFIG, split_k=proj_split)
        else:
            project(w8a8_in(x), wq_a, raw, w2=wkv, config=PROJ_CONFIG)

    def kv_finish():
        _kv_finish_kernel[(b,)](
            raw,
            proj_parts,
            kv_norm,
            q_norm,
            qn,
            cache,
            table,
            positions,
            inv_freq,
            arrivals,
            raw.stride(0),
            q_lora,
            qn.stride(0),
            cache.stride(0),
            table.stride(0),
            positions.stride(0),
            max_blocks,
            num_slots,
            arrivals.numel(),
            eps,
            HEAD_DIM=d,
            HALF=d // 2,
            N_PAIR0=n // 2,
            BS=bs,
            FP8=bool(attrs.get("kv_fp8_round", False)),
            FP8_PAIRS=32,
            QA_BLOCK=norm_block(q_lora, w8a8 and not q_on_cores),
            SPLIT=proj_split,
            CNT_BLOCK=next_pow2(cnt_share) if arrivals.numel() else 0,
            ROUND_QN=w8a8 and not q_on_cores,
            num_warps=4,
            **pdl_args(x.device),
        )

    def q_proj():  # q = qn @ wq_b^T, qn = q_norm(qa) from kv finish (W8A8: rounded there, or by wq_b's kernel)
        if q_on_cores:
            project(qn, wq_b, q, config=Q_CONFIG, act_fp8=True, fp8_config=Q_W8A8_CORE_CONFIG)
        else:
            project(qn, wq_b, q, config=Q_CONFIG)

    def attend():
        common = (
            q,
            cache,
            table,
            positions,
            kv_start,
            sink,
            inv_freq,
            o,
            q.stride(0),
            cache.stride(0),
            table.stride(0),
            o.stride(0),
            positions.stride(0),
            kv_start.stride(0),
        )
        if ATTN_IMPL == "dot":
            block_h, block_w = min(DOT_BLOCK_H, max(16, next_pow2(h))), _dot_block_w(window)
            _swa_decode_dot_kernel[(b, triton.cdiv(h, block_h), parts)](
                *common[:8],
                window_partials,
                arrivals,
                *common[8:],
                h,
                max_blocks,
                num_slots,
                eps,
                1.0 / math.sqrt(d),
                HEAD_DIM=d,
                N_PAIR0=n // 2,
                BS=bs,
                WINDOW=window,
                BLOCK_W=block_w,
                BLOCK_H=block_h,
                PARTS=parts,
                PART_KEYS=triton.cdiv(window, block_w) // parts * block_w,
                INTERP=interpreting(),
                num_warps=DOT_WARPS,
                num_stages=DOT_STAGES,
                **pdl_args(x.device),
            )
        else:
            _swa_decode_kernel[(b, h)](
                *common,
                max_blocks,
                num_slots,
                eps,
                1.0 / math.sqrt(d),
                HEAD_DIM=d,
                HALF=d // 2,
                N_PAIR0=n // 2,
                BS=bs,
                WINDOW=window,
                BLOCK_W=min(BLOCK_W, next_pow2(window)),
                num_warps=ATTN_WARPS,
                **pdl_args(x.device),
            )

    def wo_a_():  # z_g = wo_a[g] @ o_g; W8A8 rounds o per group, as the reference's [G, B, H/G*d] view
        o_in = w8a8_in(o.view(b, groups, -1)).view(b, -1)
        project(o_in, wo_a, z, group_rows=o_lora, config=WO_A_CONFIG, **wo_reduce(attend_tiles, tiles_a))

    def wo_b_():
        project(w8a8_in(z), wo_b, outputs[0], config=WO_B_CONFIG, **wo_reduce(attend_tiles + tiles_a, tiles_b))

    def wo_reduce(first: int, tiles: int) -> dict:
        if wo_split == 1:
            return {}
        return {"split_k": wo_split, "split_reduce": (wo_parts, arrivals[first : first + tiles])}

    return [
        ("proj", proj_),
        ("kv_finish", kv_finish),
        ("q_proj", q_proj),
        ("attend", attend),
        ("wo_a", wo_a_),
        ("wo_b", wo_b_),
    ]


def swa_attention_impl(inputs, outputs, attrs, workspace):
    """The fused swa_attention (see the module docstring); the torch op where the kernels do not apply."""
    if not _usable(inputs, attrs) or outputs[0].stride(1) != 1:
        from draftgraph.ops.attention import _attn_impl

        return _attn_impl(inputs, outputs, attrs, workspace)
    for _, launch in plan(inputs, outputs, attrs, workspace):
        launch()


swa_attention_impl.unsupported_block_scaled = attention_block_scaled
