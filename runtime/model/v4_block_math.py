"""The math of one DeepSeek-V4 block as pure torch functions (spec sections 2-4).

Used by :class:`draftgraph.runtime.model.v4_block_module.V4Block` (both forwards) and by the tiny model.
Every function works on any number of leading batch dims (``...``), computes in fp32 and casts
back only where the spec says so, so the same code serves bf16 inference and fp32 training.
This file is written from the spec alone, independently of the graph ops in ``ops/``; the two
are compared by tests elsewhere, so it follows the spec literally rather than cleverly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KV_BLOCK_SIZE = 16  # tokens per paged-cache block (spec section 3, "Paged cache")


# ---- norms -------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Vanilla RMS norm ``w * x / sqrt(mean(x^2) + eps)`` in fp32, cast back to ``x.dtype``.

    ``weight=None`` is the weightless per-head q norm of the attention.
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


# ---- RoPE (interleaved pairs on the last r dims) -----------------------------------------------


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``p * theta^(-2i/r)`` for every position: ``[..., r/2]`` each, fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device).float() / rope_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq  # [..., r/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the adjacent pairs (2i, 2i+1) of the last ``r = 2 * cos.shape[-1]`` dims of ``x``.

    ``cos``/``sin`` must broadcast against ``x[..., :r/2]``. ``inverse`` rotates by ``-p``: the
    attention output is un-rotated so that the value part leaves the head position-free.
    """
    half = cos.shape[-1]
    n = x.shape[-1] - 2 * half
    if inverse:
        sin = -sin
    pairs = x[..., n:].float().unflatten(-1, (half, 2))  # [..., r/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :n], rotated.to(x.dtype)), dim=-1)


# ---- mHC (manifold-constrained hyper-connections) ----------------------------------------------


def hc_expand(h: torch.Tensor, num_streams: int) -> torch.Tensor:
    """``[..., D] -> [..., C, D]``: C identical copies (the first layer of the target)."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], num_streams, h.shape[-1]).contiguous()


def _hc_mix(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``(x @ fn^T) * rho`` with rho the inverse RMS of the flattened streams: ``[..., rows]``."""
    x = X.flatten(-2).float()  # [..., C*D]
    rho = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)
    return F.linear(x, fn.float()) * rho


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Near doubly-stochastic ``[..., C, C]`` from logits (row j, column k), in the spec's order.

    One row softmax (+eps), one column normalisation, then ``iters - 1`` (row, column) pairs:
    for 20 iterations that is 20 column and 19 row normalisations.
    """
    M = torch.softmax(logits.float(), dim=-1) + eps
    M = M / (M.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + eps)
        M = M / (M.sum(-2, keepdim=True) + eps)
    return M


def hc_pre(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams for one half-block.

    Parameters
    ----------
    X : ``[..., C, D]`` residual streams.
    fn, base, scale : fp32 ``[(2+C)*C, C*D]``, ``[(2+C)*C]``, ``[3]``.

    Returns
    -------
    y ``[..., D]`` in ``X.dtype``, post ``[..., C]`` fp32, comb ``[..., C, C]`` fp32.
    """
    C = X.shape[-2]
    m = _hc_mix(X, fn, norm_eps)  # [..., (2+C)*C]
    base = base.float()
    scale = scale.float()
    # pre is deliberately not normalised (spec 2.5): the block learns the input's scale.
    pre = torch.sigmoid(m[..., :C] * scale[0] + base[:C]) + hc_eps  # [..., C]
    post = 2.0 * torch.sigmoid(m[..., C : 2 * C] * scale[1] + base[C : 2 * C])  # [..., C]
    logits = (m[..., 2 * C :] * scale[2] + base[2 * C :]).unflatten(-1, (C, C))  # [..., C(j), C(k)]
    comb = sinkhorn(logits, iters, hc_eps)
    y = (pre.unsqueeze(-1) * X.float()).sum(-2)  # [..., D]
    return y.to(X.dtype), post, comb


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'[k] = post_k * y + sum_j comb[j, k] * X[j]`` in fp32, out in ``X.dtype``.

    The residual is mixed by comb TRANSPOSED (column k gathers stream k's inputs); using
    ``comb @ X`` instead is the classic bug, caught by tests/test_v4_block_module.py.
    """
    mixed = comb.float().transpose(-1, -2) @ X.float()  # [..., C(k), D]
    out = post.float().unsqueeze(-1) * y.float().unsqueeze(-2) + mixed
    return out.to(X.dtype)


def hc_head(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Collapse the streams before the final norm: ``[..., C, D] -> [..., D]`` (no Sinkhorn)."""
    m = _hc_mix(X, fn, norm_eps)  # [..., C]
    g = torch.sigmoid(m * scale.float()[0] + base.float()) + hc_eps
    return (g.unsqueeze(-1) * X.float()).sum(-2).to(X.dtype)


# ---- attention ---------------------------------------------------------------------------------


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with a learned sink logit in the denominator only.

    With ``mu = max(max_valid s, sink)``: ``w_j = exp(s_j - mu) / (sum_valid exp(s - mu) +
    exp(sink - mu))``, so the weights sum to less than one and the sink contributes no value.
    ``sink`` broadcasts against ``scores[..., :1]``; ``valid`` (bool) against ``scores``. A row with
    no valid key gets all-zero weights (not NaN). Masked scores are replaced by the sink rather
    than -inf: exp(-inf) takes a slow path on CPU, and the product with ``valid`` zeroes them anyway.
    """
    s = scores.float()
    sink = sink.float().expand(*s.shape[:-1], 1)
    s = torch.where(valid, s, sink)
    mu = torch.maximum(s.amax(-1, keepdim=True), sink).detach()  # any shift is exact; detach is free
    e = torch.exp(s - mu) * valid
    return e / (e.sum(-1, keepdim=True) + torch.exp(sink - mu))


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Key j is visible from query i when ``q - window < k <= q``: ``[..., Tq, Tk]`` bool."""
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    return (k <= q) & (k > q - window)


_FAR = 2**40  # a position no window reaches: marks padding keys as invisible


def local_attention(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, sink: torch.Tensor, window: int, scale: float
) -> torch.Tensor:
    """Causal sliding-window attention with sink over whole rows: ``[B, T, H, d]`` fp32.

    q ``[B, T, H, d]``, kv ``[B, T, d]`` (key = value), positions ``[B, T]`` strictly increasing,
    sink ``[H]``. Long rows are cut into chunks of ``window`` queries that see their own and the
    previous chunk only (no visible key is further back than that), so the cost is linear in T.
    """
    B, T, H, d = q.shape
    if T <= 2 * window:
        scores = torch.einsum("bthd,bsd->bhts", q, kv) * scale  # [B, H, T, T]
        visible = window_mask(positions, positions, window).unsqueeze(1)
        w = sink_softmax(scores, sink.view(1, -1, 1, 1), visible)
        return torch.einsum("bhts,bsd->bthd", w, kv)
    L = window
    n = -(-T // L)
    pad = n * L - T
    q = F.pad(q, (0, 0, 0, 0, 0, pad)).view(B, n, L, H, d)
    kv = F.pad(kv, (0, 0, 0, pad)).view(B, n, L, d)
    q_pos = F.pad(positions, (0, pad), value=_FAR).view(B, n, L)  # padded queries are dropped below
    keys = torch.cat((F.pad(kv, (0, 0, 0, 0, 1, 0))[:, :-1], kv), dim=2)  # [B, n, 2L, d]
    prev_pos = F.pad(q_pos, (0, 0, 1, 0), value=-_FAR)[:, :-1]
    k_pos = torch.cat((prev_pos, q_pos), dim=2)  # [B, n, 2L]
    scores = torch.einsum("bnlhd,bnsd->bnhls", q, keys) * scale  # [B, n, H, L, 2L]
    visible = window_mask(q_pos, k_pos, window).unsqueeze(2)  # [B, n, 1, L, 2L]
    w = sink_softmax(scores, sink.view(1, 1, -1, 1, 1), visible)
    o = torch.einsum("bnhls,bnsd->bnlhd", w, keys)  # [B, n, L, H, d]
    return o.reshape(B, n * L, H, d)[:, :T]


# ---- paged latent cache (capture-safe: no host syncs, no data-dependent Python branches) -------


def paged_slots(positions: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of each position through its row's block table, and whether it is mapped.

    positions ``[B, ...]`` int64, block_table ``[B, max_blocks]`` int32 (-1 = unmapped).
    Returns slots int64 (0 where unmapped, safe to index) and a bool mask, both ``positions.shape``.
    """
    max_blocks = block_table.shape[1]
    logical = torch.div(positions, KV_BLOCK_SIZE, rounding_mode="floor")
    in_range = (positions >= 0) & (logical < max_blocks)
    logical = logical.clamp(0, max_blocks - 1).reshape(positions.shape[0], -1)
    physical = block_table.long().gather(1, logical).reshape(positions.shape)
    mapped = in_range & (physical >= 0)
    slots = physical * KV_BLOCK_SIZE + positions.remainder(KV_BLOCK_SIZE)
    return torch.where(mapped, slots, torch.zeros_like(slots)), mapped


def paged_write(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, mapped: torch.Tensor) -> None:
    """``cache[slots[b]] = rows[b]`` for mapped rows only, without a host sync.

    An unmapped (padded) row is redirected to the slot and value of the first mapped row, so
    its duplicate write is identical and harmless; when no row is mapped every row writes
    ``cache[0]`` back onto itself. Either way a padded row changes nothing.
    """
    rows = rows.to(cache.dtype)
    # A [1] index tensor, not a 0-dim one: indexing with a 0-dim tensor would call .item().
    first = torch.argmax(mapped.to(torch.int8)).view(1)  # first mapped row (0 when none is)
    any_mapped = mapped.any()
    fallback_slot = torch.where(any_mapped, slots.index_select(0, first), 0)  # [1]
    fallback_row = torch.where(any_mapped, rows.index_select(0, first), cache[:1])  # [1, d]
    slots = torch.where(mapped, slots, fallback_slot)
    rows = torch.where(mapped.unsqueeze(-1), rows, fallback_row)
    cache.index_put_((slots,), rows)


def paged_window(
    cache: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    kv_start: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the W = ``window`` keys ending at each row's position: ``[B, W, d]`` fp32 and a mask.

    Key w of row b is position ``p_b - W + 1 + w``; it is valid when it is >= max(0, kv_start_b)
    and mapped. Invalid keys read as zeros so stale or poisoned slots cannot leak in as NaN.
    """
    offsets = torch.arange(window - 1, -1, -1, device=positions.device)  # [W]: oldest first
    key_pos = positions.long().unsqueeze(-1) - offsets  # [B, W]
    slots, mapped = paged_slots(key_pos, block_table)
    valid = mapped & (key_pos >= kv_start.long().unsqueeze(-1))
    keys = cache[slots].float()  # [B, W, d]
    keys = torch.where(valid.unsqueeze(-1), keys, torch.zeros_like(keys))
    return keys, valid


# ---- MoE ---------------------------------------------------------------------------------------


def gate_scores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """sqrtsoftplus scores ``sqrt(softplus(x @ W_g^T))`` in fp32: ``[..., E]``."""
    return torch.sqrt(F.softplus(F.linear(x.float(), gate_weight.float())))


def routing_weights(scores: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scores of the chosen experts, renormalised to sum 1, times routed_scaling_factor."""
    w = scores.gather(-1, idx)
    return w / w.sum(-1, keepdim=True) * scaling


def route_by_score(
    scores: torch.Tensor, bias: torch.Tensor, k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing: top-k of ``scores + bias`` (bias selects only), weights from scores."""
    idx = torch.topk(scores + bias.float(), k, dim=-1).indices  # [..., k]
    return idx, routing_weights(scores, idx, scaling)


def route_by_hash(
    scores: torch.Tensor, tid2eid: torch.Tensor, token_ids: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: the experts are ``tid2eid[token]``; weights as in score routing."""
    idx = tid2eid[token_ids.long()].long()  # [..., k]
    return idx, routing_weights(scores, idx, scaling)


def swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w2 (weight * silu(min(w1 x, limit)) * clamp(w3 x, +-limit))`` in fp32.

    The routing weight multiplies before ``w2``, as the reference does.
    """
    x = x.float()
    g = F.linear(x, w1.float()).clamp(max=limit)
    u = F.linear(x, w3.float()).clamp(-limit, limit)
    h = F.silu(g) * u
    if weight is not None:
        h = h * weight
    return F.linear(h, w2.float())
