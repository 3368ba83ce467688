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
every row rewrites slot 0 with its own old value.
"""

from __future__ import annotations

import math

import torch

from ops.basic import rms_norm_into
from ops.registry import OpDef, expect, expect_count, expect_rank, register
from ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from runtime.tensor_spec import TensorSpec

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
    q_lora, dt = wq_a.shape[0], x.dtype
    expect_spec(x, (b, dim), ACTIVATIONS, "swa_attention x")
    expect_spec(wq_a, (q_lora, dim), dt, "swa_attention wq_a")
    expect_spec(q_norm, (q_lora,), dt, "swa_attention q_norm")
    expect_spec(wq_b, (h * d, q_lora), dt, "swa_attention wq_b")
    expect_spec(wkv, (d, dim), dt, "swa_attention wkv")
    expect_spec(kv_norm, (d,), dt, "swa_attention kv_norm")
    expect_spec(wo_a, (g * o_lora, h * d // g), dt, "swa_attention wo_a")
    expect_spec(wo_b, (dim, g * o_lora), dt, "swa_attention wo_b")
    expect_spec(sink, (h,), torch.float32, "swa_attention attn_sink")
    expect_spec(cache, (cache.shape[0], d), dt, "swa_attention kv_cache")
    expect_spec(positions, (b,), torch.int64, "swa_attention positions")
    expect_spec(kv_start, (b,), torch.int32, "swa_attention kv_start")
    expect_spec(table, (b, table.shape[1]), torch.int32, "swa_attention block_table")
    return [TensorSpec((b, dim), dt)]


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float, sign: float) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of x [B, ..., r] by sign * p * theta^(-2i/r); fp32."""
    r = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, device=x.device, dtype=torch.float32) / r))
    angle = positions.float()[:, None] * inv_freq  # [B, r/2]
    angle = angle.view(angle.shape[0], *([1] * (x.dim() - 2)), r // 2)
    cos, sin = torch.cos(angle), torch.sin(angle) * sign
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def fp8_round_blocks(v: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Round v [B, n] through float8 e4m3 per block of ``block`` values, power-of-two scales."""
    n = v.shape[-1]
    padded = torch.nn.functional.pad(v, (0, (-n) % block)).view(v.shape[0], -1, block)
    amax = padded.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))  # UE8M0: a power of two
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(1)[:, :n]


def _write_kv(cache, kv, positions, table, block_size) -> torch.Tensor:
    """Write kv [B, d] at each live row's slot (see "dead rows"); returns alive [B] bool."""
    num_slots, max_blocks = cache.shape[0], table.shape[1]
    blk_idx = torch.div(positions, block_size, rounding_mode="floor")  # [B]
    blk = table.gather(1, blk_idx.clamp(0, max_blocks - 1).unsqueeze(1)).squeeze(1).long()
    slot = blk * block_size + positions.remainder(block_size)  # [B]
    alive = (positions >= 0) & (blk_idx < max_blocks) & (blk >= 0) & (slot < num_slots)
    first = torch.argmax(alive.to(torch.int32)).view(1)  # first live row, 0 if none
    any_alive = alive.any()
    donor_slot = torch.where(any_alive, slot.index_select(0, first), torch.zeros_like(first))
    donor_val = torch.where(any_alive, kv.index_select(0, first), cache[:1])  # [1, d]
    slot_w = torch.where(alive, slot, donor_slot)
    cache.index_copy_(0, slot_w, torch.where(alive.unsqueeze(1), kv, donor_val))
    return alive


def _gather_window(cache, positions, kv_start, table, alive, window, block_size):
    """Keys of positions p - window + 1 .. p: kv [B, W, d] fp32 (zeros where invalid), valid [B, W]."""
    num_slots, max_blocks = cache.shape[0], table.shape[1]
    j = positions[:, None] + torch.arange(1 - window, 1, device=positions.device)  # [B, W]
    jb = torch.div(j, block_size, rounding_mode="floor")
    blk = table.gather(1, jb.clamp(0, max_blocks - 1)).long()  # [B, W]
    slot = blk * block_size + j.remainder(block_size)
    lowest = kv_start.long().clamp_min(0)[:, None]
    valid = (j >= lowest) & (jb < max_blocks) & (blk >= 0) & (slot < num_slots) & alive[:, None]
    slot = torch.where(valid, slot, torch.zeros_like(slot))
    keys = cache.index_select(0, slot.flatten()).view(*slot.shape, cache.shape[1]).float()
    # Zero invalid keys: unwritten or poisoned rows (NaN/inf) must not leak through 0 * x.
    return torch.where(valid.unsqueeze(-1), keys, 0.0), valid


def _attn_impl(inputs, outputs, attrs, workspace):
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache, positions, kv_start, table = inputs
    h, d, r = int(attrs["num_heads"]), int(attrs["head_dim"]), int(attrs["rope_dim"])
    g, n = int(attrs["o_groups"]), d - r
    eps, theta = float(attrs["eps"]), float(attrs["rope_theta"])
    block_size = int(attrs.get("block_size", 16))
    b = x.shape[0]

    # Query: low-rank, normed, then per-head weightless RMS norm and RoPE on the last r dims.
    qa = x @ wq_a.t()  # [B, q_lora]
    rms_norm_into(qa, q_norm, eps, qa)
    q = (qa @ wq_b.t()).view(b, h, d).float()  # [B, H, d]
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    q = torch.cat((q[..., :n], rope_interleaved(q[..., n:], positions, theta, 1.0)), dim=-1)

    # The one latent kv (K = V): normed, RoPE on its tail, optionally FP8-rounded head.
    kv = (x @ wkv.t()).float()  # [B, d]
    kv = kv * torch.rsqrt(kv.square().mean(-1, keepdim=True) + eps) * kv_norm.float()
    head = fp8_round_blocks(kv[:, :n]) if attrs.get("kv_fp8_round", False) else kv[:, :n]
    kv = torch.cat((head, rope_interleaved(kv[:, n:], positions, theta, 1.0)), dim=-1)
    alive = _write_kv(cache, kv.to(cache.dtype), positions, table, block_size)

    keys, valid = _gather_window(cache, positions, kv_start, table, alive, int(attrs["window"]), block_size)
    scores = torch.einsum("bhd,bwd->bhw", q, keys) / math.sqrt(d)  # [B, H, W] fp32
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    # The sink joins the max and the denominator only; mu >= sink keeps a keyless row finite.
    mu = torch.maximum(scores.amax(-1), sink.unsqueeze(0))  # [B, H]
    weights = torch.exp(scores - mu.unsqueeze(-1))
    weights = weights / (weights.sum(-1) + torch.exp(sink - mu)).unsqueeze(-1)
    o = torch.einsum("bhw,bwd->bhd", weights, keys)  # [B, H, d]
    o = torch.cat((o[..., :n], rope_interleaved(o[..., n:], positions, theta, -1.0)), dim=-1)

    # Grouped low-rank output: z_g = wo_a[g] @ o_g, out = wo_b @ concat(z).
    o = o.to(x.dtype).view(b, g, h // g * d)  # [B, G, H/G*d]
    z = torch.einsum("bgi,goi->bgo", o, wo_a.view(g, -1, h // g * d))  # [B, G, o_lora]
    torch.matmul(z.reshape(b, -1), wo_b.t(), out=outputs[0])


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
