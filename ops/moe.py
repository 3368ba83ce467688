"""moe and moe_hash: the V4 mixture of experts (spec section 4).

Routing: s = sqrt(softplus(x @ W_g^T)) in fp32. ``moe`` picks the top-k of
s + bias (the bias steers selection only); ``moe_hash`` reads the experts from
tid2eid[token]. Either way the weights are s[idx] renormalised, times the routed
scaling factor. Experts and the shared expert are clamped SwiGLUs; the routing
weight is applied before w2, as in the reference.

The reference path gathers each row's chosen expert weights (w1[idx]) and runs
batched matmuls: index-driven, no host sync, capturable; a fused kernel should
replace it for real sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.registry import OpDef, expect, expect_count, expect_rank, register
from ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from runtime.tensor_spec import TensorSpec


def _check_experts(x, gate_w, w1, w2, w3, sw1, sw2, sw3, op: str):
    expect_rank(x, 2, f"{op} x [B, D]")
    expect_rank(w1, 3, f"{op} w1 [E, I, D]")
    expect_rank(sw1, 2, f"{op} sw1 [I, D]")
    b, dim = batch_of(x, f"{op} x"), x.shape[1]
    e, inter, dt = w1.shape[0], w1.shape[1], x.dtype
    expect_spec(x, (b, dim), ACTIVATIONS, f"{op} x")
    expect_spec(gate_w, (e, dim), dt, f"{op} gate_w")
    expect_spec(w1, (e, inter, dim), dt, f"{op} w1")
    expect_spec(w2, (e, dim, inter), dt, f"{op} w2")
    expect_spec(w3, (e, inter, dim), dt, f"{op} w3")
    shared = sw1.shape[0]
    expect_spec(sw1, (shared, dim), dt, f"{op} sw1")
    expect_spec(sw2, (dim, shared), dt, f"{op} sw2")
    expect_spec(sw3, (shared, dim), dt, f"{op} sw3")
    return b, dim, e


def gate_scores(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """s = sqrt(softplus(x @ W_g^T)), fp32: [B, E]."""
    return torch.sqrt(F.softplus(x.float() @ gate_w.float().t()))


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # The clamp is one-sided on the gate (silu is bounded below) and two-sided on up.
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


def _experts_into(inputs, idx, weights, attrs, out):
    """out = sum_k w2[idx_k] (w_k * swiglu) + shared(x): idx [B, K] i64, weights [B, K] fp32."""
    x, w1, w2, w3, sw1, sw2, sw3 = inputs
    limit = float(attrs["swiglu_limit"])
    xc = x.unsqueeze(1).unsqueeze(-1)  # [B, 1, D, 1]
    gate = torch.matmul(w1[idx], xc).squeeze(-1)  # [B, K, I]
    up = torch.matmul(w3[idx], xc).squeeze(-1)
    act = (weights.unsqueeze(-1) * _swiglu(gate, up, limit)).to(x.dtype)  # weight before w2
    routed = torch.matmul(w2[idx], act.unsqueeze(-1)).squeeze(-1)  # [B, K, D]
    shared_act = _swiglu(x @ sw1.t(), x @ sw3.t(), limit).to(x.dtype)  # [B, I]
    total = routed.float().sum(1) + (shared_act @ sw2.t()).float()  # [B, D] fp32
    out.copy_(total)


def _renormalised(scores: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    chosen = scores.gather(1, idx)  # [B, K]
    return chosen / chosen.sum(-1, keepdim=True) * scaling


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
    scores = gate_scores(x, gate_w)  # [B, E]
    idx = torch.topk(scores + gate_bias, int(attrs["top_k"]), dim=-1).indices  # bias: selection only
    weights = _renormalised(scores, idx, float(attrs["routed_scaling_factor"]))
    _experts_into((x, w1, w2, w3, sw1, sw2, sw3), idx, weights, attrs, outputs[0])


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
    idx = tid2eid.index_select(0, token).long()  # [B, K]
    weights = _renormalised(gate_scores(x, gate_w), idx, float(attrs["routed_scaling_factor"]))
    _experts_into((x, w1, w2, w3, sw1, sw2, sw3), idx, weights, attrs, outputs[0])


MOE_HASH = register(
    OpDef(
        name="moe_hash",
        family="moe",
        infer=_moe_hash_infer,
        impl=_moe_hash_impl,
        doc="Hash-routed MoE: experts tid2eid[token], weights from the gate scores, no bias.",
    )
)
