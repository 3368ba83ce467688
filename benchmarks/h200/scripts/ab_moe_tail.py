"""Scratch A/B (H200, V4-Flash shapes, K=1, torch ops, captured replay us): cuts of the routed
experts' tail and of two small GEMVs, each put in by a monkeypatch of ops.moe / ops.mhc.

- "swiglu lane": weight * clamp(up) on the side lane, right after the up GEMM (beside the gate
  GEMM); after the join, min(gate, limit) straight into fp32, silu in place, one multiply into bf16:
  three kernels after the join instead of six.
- "mm unsort": the sum over each row's K experts as one GEMM [B, N] @ [N, D] (fp32 out) with the
  0/1 matrix of which pair belongs to which row (built on the lane), instead of an index_copy
  back to (row, k) order and a sum.
- "mix+gate": the mHC mix as fn @ x^T and the MoE gate as W_g @ x^T (see ab_combine.py).

    python benchmarks/h200/scripts/ab_moe_tail.py
"""

import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ab_combine import gate_swapped, mix_swapped  # noqa: E402
from scratch_common import print_variants  # noqa: E402

import ops.mhc  # noqa: E402
import ops.moe  # noqa: E402
from ops import constants  # noqa: E402
from ops.overlap import join_side_stream, side_stream  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from tools.bench_draft import random_weights  # noqa: E402


def routed_variant(swiglu_lane: bool, mm_unsort: bool):
    def routed(x, idx, weights, w1, w2, w3, limit):
        b, k = idx.shape
        n = b * k
        order, ends = ops.moe.sorted_by_expert(idx, w1.shape[0])
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        with side_stream():
            weights_sorted = weights.flatten().index_select(0, order).unsqueeze(-1)
            up = torch._grouped_mm(rows, w3.transpose(1, 2), offs=ends)
            if swiglu_lane:
                weighted_up = torch.mul(weights_sorted, up.clamp(-limit, limit))  # [N, I] fp32
            if mm_unsort:
                owner = torch.zeros(b, n, dtype=x.dtype, device=x.device)  # owner[row, sorted pair] = 1
                at = torch.div(order, k, rounding_mode="floor") * n + constants.arange(0, n, torch.int64, x.device)
                owner.view(-1).index_fill_(0, at, 1)
        gate = torch._grouped_mm(rows, w1.transpose(1, 2), offs=ends)
        join_side_stream()
        if swiglu_lane:
            cap = constants.full(1, limit, torch.float32, gate.device)  # [1] fp32: the min is fp32, one kernel
            g = torch.minimum(gate, cap)
            act = torch.mul(F.silu(g, inplace=True), weighted_up, out=torch.empty_like(gate))
        else:
            act = ops.moe._weighted_into(weights_sorted, ops.moe._swiglu(gate, up, limit), x.dtype)
        out = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)
        if mm_unsort:
            return torch.mm(owner, out, out_dtype=torch.float32)
        routed_out = torch.empty_like(out).index_copy_(0, order, out).view(b, k, -1)
        return routed_out.sum(1, dtype=torch.float32)

    return routed


REAL = {"mix": ops.mhc._mix_logits, "gate": ops.moe.gate_scores, "routed": ops.moe.routed_grouped}


def variant(name):
    ops.mhc._mix_logits = mix_swapped if "mix" in name or "all" in name else REAL["mix"]
    ops.moe.gate_scores = gate_swapped if "gate" in name or "all" in name else REAL["gate"]
    lane, unsort = "lane" in name or "all" in name, "unsort" in name or "all" in name
    ops.moe.routed_grouped = routed_variant(lane, unsort) if lane or unsort else REAL["routed"]


dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
NAMES = ["current", "swiglu lane", "mm unsort", "mix+gate", "all", "current again"]
print_variants(cfg, weights, dev, {batch: NAMES for batch in (1, 8, 32)}, variant, width=14)
variant("current")
