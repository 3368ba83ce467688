"""moe and moe_hash: the V4 mixture of experts (spec section 4).

Routing: s = sqrt(softplus(x @ W_g^T)) in fp32. ``moe`` picks the top-k of
s + bias (the bias steers selection only); ``moe_hash`` reads the experts from
tid2eid[token]. Either way the weights are s[idx] renormalised, times the routed
scaling factor. Experts and the shared expert are clamped SwiGLUs; the routing
weight is applied before w2, as in the reference.

Routed experts, two paths, both index-driven, no host sync, capturable:

- grouped (``torch._grouped_mm``: CUDA sm90/sm100, and CPU where this torch has
  it): the B*K (row, expert) pairs are sorted by expert; one grouped GEMM per
  weight reads each chosen expert's weights in place, through the transposed
  view of the stacked tensor, with group ends from a device-side searchsorted.
  An expert with no rows is an empty group and is never read. No weight copy.
- gather (the fallback): each row's chosen experts are gathered (w1[idx]) and
  run as batched matmuls. The gather copies K experts per row (300 MB per
  step at V4-Flash shapes), so it is kept only where grouped GEMMs are missing.

The path is chosen by capability (torch version, device, dtype, alignment),
never by catching an error while running.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from draftgraph.ops import constants, quantised
from draftgraph.ops.overlap import join_side_stream, side_stream, sms_left_for_lanes
from draftgraph.ops.quantised import act_in, chosen_experts, expect_weight, is_quantised, linear_t
from draftgraph.ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec


def _check_experts(x, gate_w, w1, w2, w3, sw1, sw2, sw3, op: str):
    expect_rank(x, 2, f"{op} x [B, D]")
    expect_rank(w1, 3, f"{op} w1 [E, I, D]")
    expect_rank(sw1, 2, f"{op} sw1 [I, D]")
    b, dim = batch_of(x, f"{op} x"), x.shape[1]
    e, inter, dt = w1.shape[0], w1.shape[1], x.dtype
    expect_spec(x, (b, dim), ACTIVATIONS, f"{op} x")
    expect_spec(gate_w, (e, dim), dt, f"{op} gate_w")
    # Experts and shared expert: bf16, or block-scaled as stored (ops/quantised.py).
    expect_weight(w1, (e, inter, dim), dt, f"{op} w1")
    expect_weight(w2, (e, dim, inter), dt, f"{op} w2")
    expect_weight(w3, (e, inter, dim), dt, f"{op} w3")
    shared = sw1.shape[0]
    expect_weight(sw1, (shared, dim), dt, f"{op} sw1")
    expect_weight(sw2, (dim, shared), dt, f"{op} sw2")
    expect_weight(sw3, (shared, dim), dt, f"{op} sw3")
    return b, dim, e


def gate_scores(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """s = sqrt(softplus(x @ W_g^T)), fp32: [B, E]."""
    if x.is_cuda and x.dtype != torch.float32:
        # Half operands, fp32 accumulate and output: no fp32 copy of the gate weight.
        logits = torch.mm(x, gate_w.t(), out_dtype=torch.float32)
    else:
        logits = x.float() @ gate_w.float().t()  # CPU has no mm out_dtype
    return torch.sqrt(F.softplus(logits))


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, into ``out`` (any float dtype) if given.

    The clamp is one-sided on the gate (silu is bounded below) and two-sided on up. A clamp
    is exact in up's dtype when the limit is (V4's 10.0 is), so up is then clamped as it is
    and widened inside the product (a mixed-dtype multiply computes in fp32): no fp32 copy
    of up. The product can round straight into a bf16 ``out`` (one kernel on CUDA) instead
    of a separate cast.
    """
    return torch.mul(_gated(gate, limit), _clamped_up(up, limit), out=out)


def _gated(gate: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) in fp32: the min against an fp32 [1] limit widens gate itself (no copy first)."""
    cap = constants.full(1, limit, torch.float32, gate.device)
    return F.silu(torch.minimum(gate, cap), inplace=True)


def _clamped_up(up: torch.Tensor, limit: float) -> torch.Tensor:
    """clamp(up, -limit, limit), in up's dtype when that is exact (a mixed multiply widens it), else in fp32."""
    return up.clamp(-limit, limit) if _exact_in(limit, up.dtype) else up.float().clamp_(-limit, limit)


SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}


def _exact_in(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` has no more significant bits than ``dtype`` holds: a clamp to it is then exact.

    Plain Python on the host (torch.compile folds it to a constant). The exponent range is
    not checked: a bound beyond a dtype's range clamps nothing in that dtype either way.
    """
    bits = SIGNIFICANT_BITS.get(dtype)
    return bits is not None and math.ldexp(math.frexp(value)[0], bits).is_integer()


def _weighted_into(weights: torch.Tensor, act: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weights * act (fp32), rounded once to ``dtype`` by the multiply itself: no separate cast."""
    return torch.mul(weights, act, out=act.new_empty(act.shape, dtype=dtype))


@functools.cache
def _cpu_has_grouped_mm() -> bool:
    # Probed once on tiny CPU tensors (CPU ops are never inside a CUDA graph capture).
    try:
        a, b = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(1, 8, 8, dtype=torch.bfloat16)
        torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def can_grouped_mm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether the grouped path runs for these tensors: a host-side check of version, device, dtype, alignment."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    # Grouped GEMM operands need 16-byte aligned rows and bases.
    if any(n % 8 for n in (*w1.shape[1:], *w2.shape[1:])) or any(t.data_ptr() % 16 for t in (w1, w2, w3)):
        return False
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device)[0] in (9, 10)
    return x.device.type == "cpu" and _cpu_has_grouped_mm()


# The expert order by ranks for this many (row, expert) pairs, by torch.sort outside it. Measured
# end to end on an H200 (benchmarks/h200/ab_combine_c1c21d3.txt in git at 873b0e1, K=1 replay): B=32 (192 pairs)
# 1355 against 1372-1379 us, B=8 (48) 1163 against 1164-1166, B=1 (6) 838 against 828-829. The
# upper bound keeps the [N, N] compare small (4 MB at 2048 pairs).
RANKS_MIN_PAIRS, RANKS_MAX_PAIRS = 64, 2048


def sorted_by_expert(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, ends) of the B*K (row, expert) pairs, stably sorted by expert.

    order[j] is the pair (row * K + k) at sorted position j; ends[e] (int32) is the end of
    expert e's group. torch.sort and searchsorted, or between RANKS_MIN_PAIRS and
    RANKS_MAX_PAIRS pairs the ranks: pair i goes to position #{pairs with a smaller key},
    key = expert * N + i (distinct, so the order is the stable one), and ends[e] =
    #{pairs with expert <= e}. Both give the same order.
    """
    flat = idx.flatten()
    n = flat.numel()
    if not RANKS_MIN_PAIRS <= n <= RANKS_MAX_PAIRS:
        experts = constants.arange(0, num_experts, torch.int64, idx.device)
        expert, order = torch.sort(flat, stable=True)
        return order, torch.searchsorted(expert, experts, right=True, out_int32=True)
    pair = constants.arange(0, n, torch.int64, idx.device)
    order = torch.empty_like(pair).index_copy_(0, pair_ranks(idx), pair)
    return order, group_ends(idx, num_experts)


def pair_ranks(idx: torch.Tensor) -> torch.Tensor:
    """[N] int64: each (row, expert) pair's position in the stable by-expert order.

    Pair i's rank is #{pairs with a smaller key}, key = expert * N + i: distinct keys, so
    ranks are a permutation and ties keep pair order. An [N, N] compare and a sum.
    """
    flat = idx.flatten()
    n = flat.numel()
    key = torch.add(constants.arange(0, n, torch.int64, idx.device), flat, alpha=n)
    return (key.unsqueeze(0) < key.unsqueeze(1)).sum(1)  # row i counts the keys below key i


def group_ends(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32: ends[e] = #{pairs with expert <= e}, the grouped GEMMs' group ends. An [E, N] compare and a sum."""
    experts = constants.arange(0, num_experts, torch.int64, idx.device)
    return (idx.flatten().unsqueeze(0) <= experts.unsqueeze(1)).sum(1, dtype=torch.int32)


def one_row_pairs(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """For one row, its K (row, expert) pairs' rows, [K, D]: K copies of x, whatever the order; else None.

    One copy that needs no routing: the chain has no gather of rows after a sort.
    """
    return x.expand(k, x.shape[1]).contiguous() if x.shape[0] == 1 else None


def routed_grouped(x, idx, weights, w1, w2, w3, limit: float) -> torch.Tensor:
    """sum_k w2[idx_k] (w_k * swiglu(w1[idx_k] x, w3[idx_k] x)) by grouped GEMMs: [B, D] fp32."""
    b, k = idx.shape
    pairs, order = routed_grouped_pairs(x, idx, weights, w1, w2, w3, limit)
    if b == 1:  # every pair is the one row's: sum them as they lie, no permutation back
        return pairs.sum(0, keepdim=True, dtype=torch.float32)
    # Back to (row, k) order by a permutation (no atomics: the sum over k stays deterministic).
    routed = torch.empty_like(pairs).index_copy_(0, order, pairs).view(b, k, -1)  # [B, K, D]
    return routed.sum(1, dtype=torch.float32)


def routed_grouped_pairs(x, idx, weights, w1, w2, w3, limit: float):
    """(w2[e] (w * swiglu) per (row, expert) pair in by-expert order [N, D], that order; None for one row)."""
    b, k = idx.shape
    # The routing weights in expert order go on the lane, ahead of the up GEMM and off the main
    # stream. For one row they are forked before the group ends: their five small kernels run
    # beside those two, not behind the gate GEMM's tiles, which would hold the up GEMM back.
    if b == 1:
        # One row: its pairs' rows are all x, so the GEMMs need only the group ends (two small
        # kernels), not the pairs' order (a sort: six); the weights go to their ranks.
        rows = one_row_pairs(x, k)
        with side_stream():
            weights_sorted = _in_expert_order(weights, idx, None)  # [K, 1]
        ends = group_ends(idx, w1.shape[0])
    else:
        order, ends = sorted_by_expert(idx, w1.shape[0])  # [N = B*K] pairs grouped by expert, [E] group ends
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # [N, D]
        with side_stream():
            weights_sorted = _in_expert_order(weights, idx, order)  # [N, 1]
    # At small N a grouped GEMM is one tile per (expert, 128 outputs): 96 tiles for w1 at
    # V4-Flash's top-6, too few to stream 100 MB at full bandwidth. The up GEMM on a side
    # lane runs beside the gate GEMM, the two filling the GPU together; joined before the
    # product, while rows and ends are still alive (their bytes are the main stream's).
    # Each half of the SwiGLU right after its own GEMM (the gate's on SMs the up GEMM's tiles
    # leave free): three kernels after the later GEMM, not five.
    with side_stream():
        up = _clamped_up(_grouped(rows, w3, ends), limit)  # [N, I]
    gated = _gated(_grouped(rows, w1, ends), limit)  # [N, I] fp32
    join_side_stream()
    act = _weighted_into(weights_sorted, gated.mul_(up), x.dtype)
    return _grouped(act, w2, ends), (None if b == 1 else order)  # [N, D], expert order


def _grouped(rows: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows[group e] @ w[e]^T for each expert group (ends: the groups' ends), leaving SMs to the lanes."""
    with sms_left_for_lanes():  # a persistent GEMM: the Sinkhorn beside it waits otherwise (draftgraph.ops.overlap)
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=ends)


def _in_expert_order(weights: torch.Tensor, idx: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """[N, 1]: the pairs' routing weights in the by-expert order (``order`` None: sent to their ranks)."""
    flat = weights.flatten()
    if order is None:
        return torch.empty_like(flat).index_copy_(0, pair_ranks(idx), flat).unsqueeze(-1)
    return flat.index_select(0, order).unsqueeze(-1)


def routed_gather(x, idx, weights, w1, w2, w3, limit: float) -> torch.Tensor:
    """The same sum by gathering each row's K experts (copies them) and batched matmuls: [B, D] fp32."""
    join_side_stream()  # the weights may come from the side lane (_weights_beside)
    xc = x.unsqueeze(1).unsqueeze(-1)  # [B, 1, D, 1]
    gate = torch.matmul(w1[idx], xc).squeeze(-1)  # [B, K, I]
    up = torch.matmul(w3[idx], xc).squeeze(-1)
    act = _weighted_into(weights.unsqueeze(-1), _swiglu(gate, up, limit), x.dtype)  # weight before w2
    routed = torch.matmul(w2[idx], act.unsqueeze(-1)).squeeze(-1)  # [B, K, D]
    return routed.sum(1, dtype=torch.float32)


def routed_quantised(x, idx, weights, w1, w2, w3, limit: float, attrs) -> torch.Tensor:
    """routed_gather on block-scaled (MXFP4 / FP8) experts: only the chosen experts dequantised. [B, D] fp32.

    The same batched matmuls as the gather path, on each row's K experts dequantised to x's
    dtype (exact), so with bf16 activations it computes what the gather path computes on the
    dequantised checkpoint. W8A8 rounds x before w1 / w3 and the weighted SwiGLU before w2.
    The (row, expert) pairs go a few at a time when all of them dequantised would pass
    ``quantised.EXPERT_PAIRS_BYTES`` (V4-Flash: 50 MB a pair, so two at a time): the loop's
    length is the static B*K, so it captures, and the temporaries stay bounded at any batch.
    """
    join_side_stream()  # the weights may come from the side lane (_weights_beside)
    b, k = idx.shape
    xq = act_in(x, w1, attrs)
    inter, dim = w1.logical_shape[-2:]
    per_pair = 3 * inter * dim * x.dtype.itemsize
    step = max(1, quantised.EXPERT_PAIRS_BYTES // per_pair)
    if step >= b * k:
        return _pairs_quantised(xq.unsqueeze(1), idx, weights, w1, w2, w3, limit, attrs).sum(1, dtype=torch.float32)
    rows = xq.repeat_interleave(k, dim=0).unsqueeze(1)  # [B*K, 1, D]: each pair's row
    flat_idx, flat_w = idx.reshape(-1, 1), weights.reshape(-1, 1)
    routed = x.new_empty(b * k, 1, dim)  # [B*K, 1, D] in x's dtype, as the gather path's
    for start in range(0, b * k, step):
        stop = min(b * k, start + step)
        routed[start:stop] = _pairs_quantised(rows[start:stop], flat_idx[start:stop], flat_w[start:stop],
                                              w1, w2, w3, limit, attrs)
    return routed.view(b, k, dim).sum(1, dtype=torch.float32)


def _pairs_quantised(xc, idx, weights, w1, w2, w3, limit, attrs) -> torch.Tensor:
    """[R, K, D] in x's dtype: experts idx [R, K] on rows xc [R, 1, D] (already W8A8-rounded if asked)."""
    xc = xc.unsqueeze(-1)  # [R, 1, D, 1]
    gate = torch.matmul(chosen_experts(w1, idx, xc.dtype), xc).squeeze(-1)  # [R, K, I]
    up = torch.matmul(chosen_experts(w3, idx, xc.dtype), xc).squeeze(-1)
    act = _weighted_into(weights.unsqueeze(-1), _swiglu(gate, up, limit), xc.dtype)  # weight before w2
    act = act_in(act, w2, attrs)
    return torch.matmul(chosen_experts(w2, idx, xc.dtype), act.unsqueeze(-1)).squeeze(-1)  # [R, K, D]


def shared_expert_into(x, sw1, sw2, sw3, limit: float, out: torch.Tensor, attrs=None) -> None:
    """out = sw2 swiglu(sw1 x, sw3 x), [B, D] in x's dtype, queued on the side stream.

    It does not depend on the routing: on the executor's side stream (draftgraph.ops.overlap) its three
    GEMVs run beside the router and the routed experts; read ``out`` after ``join_side_stream()``.
    ``out`` is the op's output, whose bytes the main stream reads after the join. Block-scaled
    (FP8) weights go through ops/quantised.py, with W8A8 when the attrs ask.
    """
    with side_stream():
        if is_quantised(sw1):
            gate = linear_t(x, sw1, attrs)
            act = _swiglu(gate, linear_t(x, sw3, attrs), limit, out=torch.empty_like(gate))
            linear_t(act, sw2, attrs, out=out)
            return
        gate = x @ sw1.t()
        act = _swiglu(gate, x @ sw3.t(), limit, out=torch.empty_like(gate))  # [B, I] in x's dtype
        torch.mm(act, sw2.t(), out=out)


def _experts_into(inputs, idx, weights, attrs, out):
    """out += sum_k w2[idx_k] (w_k * swiglu): idx [B, K] i64, weights [B, K] fp32.

    ``out`` holds the shared expert (``shared_expert_into``, on the lane); the routed sum is
    added in fp32 and rounded once.
    """
    x, w1, w2, w3 = inputs[:4]
    limit = float(attrs["swiglu_limit"])
    if is_quantised(w1):
        total = routed_quantised(x, idx, weights, w1, w2, w3, limit, attrs)
    elif not can_grouped_mm(x, w1, w2, w3):
        total = routed_gather(x, idx, weights, w1, w2, w3, limit)
    elif x.shape[0] == 1:
        pairs, _ = routed_grouped_pairs(x, idx, weights, w1, w2, w3, limit)  # [K, D]
        join_side_stream()
        # One row: its K pairs summed onto the shared expert by one GEMM, ones [1, K] @ pairs,
        # accumulated in fp32 with out itself (beta = 1) and rounded once: a sum and an add otherwise.
        out.addmm_(constants.full(pairs.shape[0], 1.0, pairs.dtype, pairs.device).view(1, -1), pairs)
        return
    else:
        total = routed_grouped(x, idx, weights, w1, w2, w3, limit)  # [B, D] fp32
    join_side_stream()
    # The fp32 sum rounds once into out: one add, no fp32 accumulator copied out afterwards.
    torch.add(total, out, out=out)


def _renormalised(scores: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    chosen = scores.gather(1, idx)  # [B, K]
    return chosen / chosen.sum(-1, keepdim=True) * scaling


def _weights_beside(scores: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """The routing weights, computed on the side lane: four tiny kernels off the chain.

    Nothing reads them before the SwiGLU, after the gate GEMM; routed_grouped reads them on the
    same lane (blocks of one step run there in order) and routed_gather joins first. scores
    and idx stay referenced by the op until its join (draftgraph.ops.overlap).
    """
    with side_stream():
        return _renormalised(scores, idx, scaling)


# ---- moe (score-routed) ------------------------------------------------------


def _moe_infer(specs, attrs):
    expect_count(specs, 9, "moe")
    require_attrs(attrs, ("top_k", "routed_scaling_factor", "swiglu_limit"), "moe")
    x, gate_w, gate_bias, w1, w2, w3, sw1, sw2, sw3 = specs
    b, dim, e = _check_experts(x, gate_w, w1, w2, w3, sw1, sw2, sw3, "moe")
    expect_spec(gate_bias, (e,), torch.float32, "moe gate_bias")
    expect(1 <= int(attrs["top_k"]) <= e, "moe top_k", f"1..{e}", attrs["top_k"])
    return [TensorSpec((b, dim), x.dtype)]


def _moe_impl(inputs, outputs, attrs, workspace):
    x, gate_w, gate_bias, w1, w2, w3, sw1, sw2, sw3 = inputs
    k = int(attrs["top_k"])
    shared_expert_into(x, sw1, sw2, sw3, float(attrs["swiglu_limit"]), outputs[0], attrs)
    scores = gate_scores(x, gate_w)  # [B, E]
    # Bias: selection only. Unsorted: the experts are sorted by id next, so the k winners' own
    # sort by score (one more kernel) would be undone.
    idx = torch.topk(scores + gate_bias, k, dim=-1, sorted=False).indices
    weights = _weights_beside(scores, idx, float(attrs["routed_scaling_factor"]))
    _experts_into((x, w1, w2, w3), idx, weights, attrs, outputs[0])


MOE = register(
    OpDef(
        name="moe",
        family="moe",
        infer=_moe_infer,
        impl=_moe_impl,
        doc="Score-routed MoE: top-k of sqrtsoftplus scores + bias, clamped SwiGLU experts + shared.",
    )
)


# ---- moe_hash (token-routed) -------------------------------------------------


def _moe_hash_infer(specs, attrs):
    expect_count(specs, 10, "moe_hash")
    require_attrs(attrs, ("routed_scaling_factor", "swiglu_limit"), "moe_hash")
    x, token, tid2eid, gate_w, w1, w2, w3, sw1, sw2, sw3 = specs
    b, dim, e = _check_experts(x, gate_w, w1, w2, w3, sw1, sw2, sw3, "moe_hash")
    expect_spec(token, (b,), torch.int64, "moe_hash token")
    expect_rank(tid2eid, 2, "moe_hash tid2eid [V, k]")
    expect_spec(tid2eid, tid2eid.shape, torch.int32, "moe_hash tid2eid")
    k = tid2eid.shape[1]
    expect(1 <= k <= e, "moe_hash tid2eid experts per token", f"1..{e}", k)
    if "top_k" in attrs:
        expect(int(attrs["top_k"]) == k, "moe_hash top_k", f"tid2eid's {k}", attrs["top_k"])
    return [TensorSpec((b, dim), x.dtype)]


def _moe_hash_impl(inputs, outputs, attrs, workspace):
    x, token, tid2eid, gate_w, w1, w2, w3, sw1, sw2, sw3 = inputs
    shared_expert_into(x, sw1, sw2, sw3, float(attrs["swiglu_limit"]), outputs[0], attrs)
    idx = tid2eid.index_select(0, token).long()  # [B, K]
    scores = gate_scores(x, gate_w)
    weights = _weights_beside(scores, idx, float(attrs["routed_scaling_factor"]))
    _experts_into((x, w1, w2, w3), idx, weights, attrs, outputs[0])


MOE_HASH = register(
    OpDef(
        name="moe_hash",
        family="moe",
        infer=_moe_hash_infer,
        impl=_moe_hash_impl,
        doc="Hash-routed MoE: experts tid2eid[token], weights from the gate scores, no bias.",
    )
)


# ---- moe_shard (expert-parallel: this rank's share) ---------------------------


def _moe_shard_infer(specs, attrs):
    expect(len(specs) in (6, 9), "moe_shard inputs", "6 (x, gate, bias, w1, w2, w3) or 9 (+ the shared expert)",
           len(specs))
    require_attrs(attrs, ("top_k", "routed_scaling_factor", "swiglu_limit", "expert_start"), "moe_shard")
    x, gate_w, gate_bias, w1, w2, w3 = specs[:6]
    expect_rank(x, 2, "moe_shard x [B, D]")
    expect_rank(w1, 3, "moe_shard w1 [E/W, I, D]")
    b, dim, dt = batch_of(x, "moe_shard x"), x.shape[1], x.dtype
    expect_spec(x, (b, dim), ACTIVATIONS, "moe_shard x")
    e, (local, inter) = gate_w.shape[0], w1.shape[:2]
    expect_spec(gate_w, (e, dim), dt, "moe_shard gate_w")
    expect_spec(gate_bias, (e,), torch.float32, "moe_shard gate_bias")
    expect_weight(w1, (local, inter, dim), dt, "moe_shard w1")
    expect_weight(w2, (local, dim, inter), dt, "moe_shard w2")
    expect_weight(w3, (local, inter, dim), dt, "moe_shard w3")
    start = int(attrs["expert_start"])
    expect(0 <= start and start + local <= e, "moe_shard expert range", f"within the {e} experts",
           f"[{start}, {start + local})")
    expect(1 <= int(attrs["top_k"]) <= e, "moe_shard top_k", f"1..{e}", attrs["top_k"])
    if len(specs) == 9:
        sw1, sw2, sw3 = specs[6:]
        shared = sw1.shape[0]
        expect_weight(sw1, (shared, dim), dt, "moe_shard sw1")
        expect_weight(sw2, (dim, shared), dt, "moe_shard sw2")
        expect_weight(sw3, (shared, dim), dt, "moe_shard sw3")
    return [TensorSpec((b, dim), torch.float32)]


def local_pairs(idx: torch.Tensor, weights: torch.Tensor, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local ids, weights) of the (row, expert) pairs for experts [start, start + count) of this rank.

    A pair of another rank's expert keeps a local id that its row already reads (the row's
    highest local one; 0 when the row has none here) and weight 0: it adds an exact 0 (the
    weight multiplies the SwiGLU before w2, and the SwiGLU is clamped, so finite), and it
    makes the grouped GEMMs read no expert the rank would not read anyway (except for a row
    with no local expert at all). Device ops only: no host sync, so it captures.
    """
    local = (idx >= start) & (idx < start + count)  # [B, K]
    shifted = idx - start
    anchor = torch.where(local, shifted, -1).amax(-1, keepdim=True).clamp_(min=0)  # [B, 1]
    zero = constants.full(1, 0.0, weights.dtype, weights.device)
    return torch.where(local, shifted, anchor), torch.where(local, weights, zero)


def _moe_shard_workspace(specs, attrs, batch: int) -> int:
    """A bf16 [B, D] for the shared expert's output (on the rank that holds it)."""
    return batch * specs[0].shape[1] * specs[0].dtype.itemsize if len(specs) == 9 else 0


def _moe_shard_impl(inputs, outputs, attrs, workspace):
    x, gate_w, gate_bias, w1, w2, w3 = inputs[:6]
    (out,) = outputs  # [B, D] fp32: this rank's partial sum, added across ranks by the next all_reduce_sum
    limit = float(attrs["swiglu_limit"])
    shared = None
    if len(inputs) == 9:
        shared = workspace.view(x.dtype).view(x.shape)
        shared_expert_into(x, *inputs[6:], limit, shared, attrs)
    scores = gate_scores(x, gate_w)  # [B, E]: routing over every expert, the same on every rank
    idx = torch.topk(scores + gate_bias, int(attrs["top_k"]), dim=-1, sorted=False).indices
    weights = _renormalised(scores, idx, float(attrs["routed_scaling_factor"]))
    idx, weights = local_pairs(idx, weights, int(attrs["expert_start"]), w1.shape[0])
    if is_quantised(w1):
        total = routed_quantised(x, idx, weights, w1, w2, w3, limit, attrs)
    elif not can_grouped_mm(x, w1, w2, w3):
        total = routed_gather(x, idx, weights, w1, w2, w3, limit)
    else:
        total = routed_grouped(x, idx, weights, w1, w2, w3, limit)  # [B, D] fp32
    join_side_stream()
    if shared is None:
        out.copy_(total)
    else:
        torch.add(total, shared, out=out)  # the shared expert rounded to x's dtype first, as in ``moe``


MOE_SHARD = register(
    OpDef(
        name="moe_shard",
        family="moe",
        infer=_moe_shard_infer,
        impl=_moe_shard_impl,
        workspace=_moe_shard_workspace,
        doc="This rank's share of the score-routed MoE (experts [expert_start, +E/W), + shared if held): fp32.",
    )
)
