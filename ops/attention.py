"""swa_attention: the MTP layer's sliding-window decode attention with a sink (spec section 3).

One token per batch row at absolute position ``positions[b]``. The latent kv
(one KV head, K = V) is written into a paged cache first, then the row attends
to the fixed window of positions p - window + 1 .. p gathered through its block
table. Everything is shape-static and index-driven: no host sync, so the op
captures into a CUDA graph with positions and block tables advancing on device.

Note "dead rows": a padded row (block-table entry -1 at its position) must not
write the cache. Writing its old value back at a clamped slot races with a live
row that writes the same slot (index_copy with duplicate indices keeps an
arbitrary one). Instead a dead row repeats the write of the first live row
(same slot, same value), so duplicates always agree; with no live row at all
every row rewrites slot 0 with slot 0's old value.

RoPE is built once per call as a complex rotation per row (``rope_rotation``)
and applied in place to q, kv and (inverted) o as one complex multiply each.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from draftgraph.ops import constants
from draftgraph.ops.overlap import join_side_stream, side_stream, sms_left_for_lanes
from draftgraph.ops.quantised import expect_weight, grouped_linear_t, linear_t
from draftgraph.ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec

ATTRS = ("num_heads", "head_dim", "rope_dim", "o_groups", "o_lora_rank", "window", "rope_theta", "eps")
FP8_MAX = 448.0  # largest finite float8 e4m3fn
FP8_BLOCK = 64


def _attn_infer(specs, attrs):
    expect_count(specs, 13, "swa_attention")
    require_attrs(attrs, ATTRS, "swa_attention")
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache, positions, kv_start, table = specs
    h, d, r = int(attrs["num_heads"]), int(attrs["head_dim"]), int(attrs["rope_dim"])
    g, o_lora = int(attrs["o_groups"]), int(attrs["o_lora_rank"])
    expect(0 < r < d and r % 2 == 0, "swa_attention rope_dim", f"even and in (0, {d})", r)
    expect(h % g == 0, "swa_attention o_groups", f"a divisor of num_heads {h}", g)
    expect(int(attrs["window"]) >= 1, "swa_attention window", ">= 1", attrs["window"])
    expect(int(attrs.get("block_size", 16)) >= 1, "swa_attention block_size", ">= 1", attrs.get("block_size"))
    expect_rank(x, 2, "swa_attention x [B, D]")
    expect_rank(wq_a, 2, "swa_attention wq_a [q_lora, D]")
    expect_rank(cache, 2, "swa_attention kv_cache [S, d]")
    expect_rank(table, 2, "swa_attention block_table [B, MB]")
    b, dim = batch_of(x, "swa_attention x"), x.shape[1]
    q_lora, dt = wq_a.logical_shape[0], x.dtype
    expect_spec(x, (b, dim), ACTIVATIONS, "swa_attention x")
    # The five linears: bf16, or block-scaled as stored (ops/quantised.py).
    expect_weight(wq_a, (q_lora, dim), dt, "swa_attention wq_a")
    expect_spec(q_norm, (q_lora,), dt, "swa_attention q_norm")
    expect_weight(wq_b, (h * d, q_lora), dt, "swa_attention wq_b")
    expect_weight(wkv, (d, dim), dt, "swa_attention wkv")
    expect_spec(kv_norm, (d,), dt, "swa_attention kv_norm")
    expect_weight(wo_a, (g * o_lora, h * d // g), dt, "swa_attention wo_a")
    expect_weight(wo_b, (dim, g * o_lora), dt, "swa_attention wo_b")
    expect_spec(sink, (h,), torch.float32, "swa_attention attn_sink")
    expect_spec(cache, (cache.shape[0], d), dt, "swa_attention kv_cache")
    expect_spec(positions, (b,), torch.int64, "swa_attention positions")
    expect_spec(kv_start, (b,), torch.int32, "swa_attention kv_start")
    expect_spec(table, (b, table.shape[1]), torch.int32, "swa_attention block_table")
    return [TensorSpec((b, dim), dt)]


def rope_rotation(positions: torch.Tensor, rope_dim: int, theta: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(i * p * theta^(-2k/r)) for the r/2 pairs k: complex64 [B, r/2] (into ``out``), built once per op call.

    The frequencies and the unit modulus are constants (draftgraph.ops.constants): two kernels fewer a step.
    """
    r, device = rope_dim, positions.device
    inv_freq = constants.logspace(-(r - 2) / r, r // 2, theta, torch.float32, device)  # theta^(-2k/r)
    angle = positions.unsqueeze(1) * inv_freq  # [B, r/2] fp32
    return torch.polar(constants.full(1, 1.0, torch.float32, device).expand_as(angle), angle, out=out)


def rotate_pairs_(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> None:
    """Rotate adjacent pairs (2k, 2k+1) of fp32 x [B, ..., r] in place by rotation [B, r/2] (or by its inverse).

    A pair is one complex number, so RoPE is one complex multiply on a view of x; the
    inverse divides instead (|rotation| = 1), which needs no conj copy.
    """
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # [B, ..., r/2]
    rot = rotation.view(rotation.shape[0], *([1] * (pairs.dim() - 2)), rotation.shape[1])
    if inverse:
        pairs.div_(rot)
    else:
        pairs.mul_(rot)


def fp8_round_blocks_(v: torch.Tensor, block: int = FP8_BLOCK) -> None:
    """Round fp32 v [B, n] in place through float8 e4m3 per block of ``block`` values, power-of-two scales.

    scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (UE8M0), exactly: by bit arithmetic on the
    fp32 word, as the fused kernel does, not through a rounded log2. Ten kernels at
    V4-Flash's n = 448 with ``kv_fp8_round`` on (seven whole blocks, a strided view: no padded copy).
    """
    b, n = v.shape
    if n % block:  # a partial last block: round a zero-padded copy
        padded = F.pad(v, (0, -n % block))
        fp8_round_blocks_(padded, block)
        v.copy_(padded[:, :n])
        return
    blocks = v.view(b, n // block, block)
    scale = torch.linalg.vector_norm(blocks, float("inf"), dim=-1, keepdim=True)  # amax [B, n/block, 1]
    _pow2_ceil_(scale.clamp_min_(1e-4).div_(FP8_MAX))
    # The clamp only catches amax / 448 rounding down onto a power of two.
    q = torch.div(blocks, scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    torch.mul(q.float(), scale, out=blocks)


def _pow2_ceil_(y: torch.Tensor) -> None:
    """y = 2^ceil(log2 y) in place, for normal fp32 y > 0: a mantissa carry into the exponent."""
    bits = y.view(torch.int32)
    bits.add_(0x7FFFFF).bitwise_and_(0x7F800000)


def _window_slots(positions, kv_start, table, window, block_size, num_slots):
    """Cache slots of positions p - window + 1 .. p: slot [B, W] i64, ok [B, W] (slot exists), in_window [B, W].

    The last column is position p itself, the slot the op writes, so one index
    computation serves the write and the window. slot = table[j // bs] * bs + j % bs
    = j + (table[j // bs] - j // bs) * bs. A slot exists when its block index is inside
    the table and the slot inside the cache; a -1 (or any negative) table entry gives a
    negative slot, so one clamp-and-compare checks both the entry and the cache bound.
    """
    max_blocks = table.shape[1]
    j = positions.unsqueeze(1) + constants.arange(1 - window, 1, torch.int64, positions.device)  # [B, W]
    jb = torch.div(j, block_size, rounding_mode="floor")
    jb_in = jb.clamp(0, max_blocks - 1)
    slot = torch.add(j, table.gather(1, jb_in) - jb, alpha=block_size)  # [B, W]
    slot_in = slot.clamp(0, num_slots - 1)
    ok = (jb_in == jb) & (slot_in == slot)  # jb >= 0 also means j >= 0: floor division
    return slot_in, ok, j >= kv_start.unsqueeze(1)


def _write_kv(cache, kv, slot, alive) -> None:
    """Write kv [B, d] at slot [B] of each live row (see "dead rows")."""
    if slot.shape[0] == 1:
        # One row: no other write to collide with. Dead, it writes slot 0's own value back to
        # slot 0 (read before the copy, in the where): three kernels where the donor takes ten.
        cache.index_copy_(0, slot * alive, torch.where(alive.unsqueeze(1), kv, cache[:1]))
        return
    # The max runs on int32, not bool: inductor's CPU code for a bool max does not compile.
    any_alive, first = alive.to(torch.int32).max(0, keepdim=True)  # the first live row, if any
    donor_slot = slot.index_select(0, first) * any_alive  # [1]; slot 0 when no row is live
    donor_val = torch.where(any_alive.bool(), kv.index_select(0, first), cache[:1])  # [1, d]
    slot_w = torch.where(alive, slot, donor_slot)
    cache.index_copy_(0, slot_w, torch.where(alive.unsqueeze(1), kv, donor_val))


def _sink_softmax(q, keys, hidden, sink, scale: float) -> torch.Tensor:
    """Softmax weights [B, H, W] of q [B, H, d] over keys [B, W, d], with the sink [H] in the denominator.

    The sink is one more column: softmax over [scores, sink] is exp(s - mu) / (sum + exp(sink - mu))
    with mu = max(max s, sink), the sink joining the max and the denominator only. The GEMM
    writes the scores straight into the first W columns of that [B, H, W+1] buffer (beta = 0:
    the buffer's old contents are not read), the hidden keys are masked to -inf in place and
    the sink copied into the last column: three kernels, where a bias tensor, a baddbmm with
    it and a cat took six. A keyless row gets all 0 (its sink takes everything), so o = 0.
    """
    b, h, window = q.shape[0], q.shape[1], keys.shape[1]
    scores = q.new_empty(b, h, window + 1)
    scores[..., :window].baddbmm_(q, keys.transpose(1, 2), beta=0.0, alpha=scale)
    scores[..., :window].masked_fill_(hidden.unsqueeze(1), float("-inf"))
    scores[..., window].copy_(sink.expand(b, h))
    return torch.softmax(scores, dim=-1)[..., :window]


def _attn_impl(inputs, outputs, attrs, workspace):
    with sms_left_for_lanes():  # its GEMVs leave SMs to the Sinkhorn beside it (draftgraph.ops.overlap)
        _attend(inputs, outputs, attrs)


def _attend(inputs, outputs, attrs):
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache, positions, kv_start, table = inputs
    h, d, r = int(attrs["num_heads"]), int(attrs["head_dim"]), int(attrs["rope_dim"])
    g, n = int(attrs["o_groups"]), d - r
    window = int(attrs["window"])
    b = x.shape[0]
    # What the kv path hands over, allocated here, on the main stream, before the fork
    # (draftgraph.ops.overlap): the rotation (shared by q, kv and o), the window's keys and their mask,
    # and the latent kv between its two blocks.
    rotation = torch.empty(b, r // 2, dtype=torch.complex64, device=x.device)
    keys = torch.empty(b, window, d, dtype=torch.float32, device=x.device)
    hidden = torch.empty(b, window, dtype=torch.bool, device=x.device)
    kv = torch.empty(b, d, dtype=cache.dtype, device=x.device)
    # Three paths: the latent kv (one 4 MB GEMV and ~20 small kernels), the window's slots
    # (~15 index kernels on positions and tables alone) and the query (two GEMVs of 72 MB).
    # The kv runs on a side lane while the main stream computes the slots; then the lane
    # writes the cache and gathers the keys (which needs both) while the main stream runs
    # the query path; the join comes before the scores. The slots stay referenced here
    # until that join: the lane reads them.
    with side_stream():
        _latent_kv(inputs, attrs, rotation, kv)
    slot, alive = _window_mask(inputs, attrs, hidden)
    with side_stream():
        _write_kv(cache, kv, slot[:, -1], alive)
        gathered = cache.index_select(0, slot.flatten()).view(b, window, d)
        # Hidden keys zeroed and the rest widened in one kernel: the fp32 [1] zero makes the where fp32.
        torch.where(hidden.unsqueeze(-1), constants.full(1, 0.0, torch.float32, x.device), gathered, out=keys)

    # Query: low-rank, normed, then per-head weightless RMS norm (fp32) and RoPE on the last r dims.
    eps = float(attrs["eps"])
    qa = F.rms_norm(linear_t(x, wq_a, attrs), (q_norm.shape[0],), q_norm, eps)  # [B, q_lora]
    q = F.rms_norm(linear_t(qa, wq_b, attrs).view(b, h, d).float(), (d,), eps=eps)  # [B, H, d] fp32
    join_side_stream()
    rotate_pairs_(q[..., n:], rotation)
    weights = _sink_softmax(q, keys, hidden, sink, 1.0 / math.sqrt(d))
    o = torch.bmm(weights, keys)  # [B, H, d]
    rotate_pairs_(o[..., n:], rotation, inverse=True)

    # Grouped low-rank output: z_g = wo_a[g] @ o_g, out = wo_b @ concat(z).
    # z is written as [B, G, o_lora] through a transposed out (the GEMM takes the strides), so
    # concat(z) is a view, not a copy.
    o = o.to(x.dtype).view(b, g, h // g * d).transpose(0, 1)  # [G, B, H/G*d]
    z = o.new_empty(b, g, wo_a.shape[0] // g)  # [B, G, o_lora]
    grouped_linear_t(o, wo_a, g, z.transpose(0, 1), attrs)
    linear_t(z.view(b, -1), wo_b, attrs, out=outputs[0])


def _latent_kv(inputs, attrs, rotation, kv) -> None:
    """The RoPE rotation into ``rotation`` [B, r/2] and the latent kv into ``kv`` [B, d] (cache dtype).

    K = V, one vector: normed, RoPE on its tail, optionally FP8-rounded head, all in fp32 and
    rounded to the cache dtype once (a bf16 rounding before the FP8 one would move values
    that sit near an FP8 tie by a whole FP8 step). Reads x, wkv, kv_norm and the positions.
    """
    x, wkv, kv_norm, positions = (inputs[i] for i in (0, 4, 5, 10))
    d, r = int(attrs["head_dim"]), int(attrs["rope_dim"])
    rope_rotation(positions, r, float(attrs["rope_theta"]), out=rotation)
    latent = F.rms_norm(linear_t(x, wkv, attrs).float(), (d,), kv_norm.float(), float(attrs["eps"]))  # [B, d] fp32
    rotate_pairs_(latent[:, d - r :], rotation)
    if attrs.get("kv_fp8_round", False):
        fp8_round_blocks_(latent[:, : d - r])
    kv.copy_(latent)


def _window_mask(inputs, attrs, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's cache slots [B, W] and whether each row is alive [B]; writes ``hidden`` [B, W].

    ``hidden`` marks keys the row must not see: outside the cache or the table, before
    kv_start, or any key of a dead row. Index math on positions and tables only.
    """
    cache, positions, kv_start, table = (inputs[i] for i in (9, 10, 11, 12))
    window, block_size = int(attrs["window"]), int(attrs.get("block_size", 16))
    slot, ok, in_window = _window_slots(positions, kv_start, table, window, block_size, cache.shape[0])
    alive = ok[:, -1]  # [B]: the row's own slot exists (so p >= 0)
    # Invalid keys are zeroed after the gather: unwritten or poisoned rows (NaN/inf) must
    # not leak through 0 * x.
    torch.logical_not(ok & in_window & alive.unsqueeze(1), out=hidden)
    return slot, alive


SWA_ATTENTION = register(
    OpDef(
        name="swa_attention",
        family="attention",
        infer=_attn_infer,
        impl=_attn_impl,
        mutates=(9,),
        doc="MTP decode attention: sliding window over a paged latent cache, sink in the denominator.",
    )
)
