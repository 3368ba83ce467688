"""Scratch A/B (H200, V4-Flash shapes, K=1, torch ops, captured replay us): the combine op against
the five nodes it replaced, and three candidate cuts of the torch ops, each put in by a monkeypatch.

- "five nodes": the combiner as it was: rms_norm x2, linear x2, hc_expand, add, in a row.
- "mix fn@x": the mHC mix GEMV as fn @ x^T (a [M, 1] GEMV) instead of x @ fn^T (cuBLAS's dot
  kernel plus a reduce at B=1).
- "gate w@x": the MoE gate logits as W_g @ x^T instead of x @ W_g^T (both fp32 out).
- "rank routing": the expert order from ranks (a compare and a sum over [N, N] pairs) and the group
  ends from a compare and a sum over [E, N], instead of torch.sort and searchsorted.

    python benchmarks/h200/scripts/ab_combine.py
"""

import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from scratch_common import print_variants  # noqa: E402

import graphs.draft_chain as chain  # noqa: E402
import ops.mhc  # noqa: E402
import ops.moe  # noqa: E402
from ops import constants  # noqa: E402
from ops.overlap import join_side_stream, side_stream  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from runtime.tensor_spec import TensorSpec  # noqa: E402
from tools.bench_draft import random_weights  # noqa: E402

BF16 = torch.bfloat16


def five_nodes(b, config, token, hidden, mode):
    d, attrs = config.hidden_size, {"eps": float(config.rms_norm_eps)}
    embed = b.op("embed", [token, b.weight("embed.weight", TensorSpec((config.vocab_size, d), BF16))])
    enorm = b.op("rms_norm", [embed, b.weight("mtp.0.enorm.weight", TensorSpec((d,), BF16))], name="enorm",
                 attrs=attrs)
    hnorm = b.op("rms_norm", [hidden, b.weight("mtp.0.hnorm.weight", TensorSpec((d,), BF16))], name="hnorm",
                 attrs=attrs)
    e_proj = b.op("linear", [enorm, b.weight("mtp.0.e_proj.weight", TensorSpec((d, d), BF16))], name="e_proj")
    h_proj = b.op("linear", [hnorm, b.weight("mtp.0.h_proj.weight", TensorSpec((d, d), BF16))], name="h_proj")
    e_streams = b.op("hc_expand", [e_proj], name="hc_expand", attrs={"hc_mult": config.hc_mult})
    return b.op("add", [h_proj, e_streams], name="combiner")


def mix_swapped(Xf, fn, eps):
    x = Xf.flatten(1)
    return (fn @ F.rms_norm(x, x.shape[-1:], eps=eps).t()).t()


def gate_swapped(x, gate_w):
    return torch.sqrt(F.softplus(torch.mm(gate_w, x.t(), out_dtype=torch.float32).t()))


def routed_by_ranks(x, idx, weights, w1, w2, w3, limit):
    b, k = idx.shape
    n = b * k
    flat = idx.flatten()
    pair = constants.arange(0, n, torch.int64, idx.device)
    key = torch.add(pair, flat, alpha=n)  # unique: expert-major, then pair order (a stable sort)
    rank = (key.unsqueeze(0) < key.unsqueeze(1)).sum(1)  # [N]: where pair i goes
    experts = constants.arange(0, w1.shape[0], torch.int64, idx.device)
    ends = (flat.unsqueeze(0) <= experts.unsqueeze(1)).sum(1, dtype=torch.int32)  # [E]
    row_of_pair = torch.div(pair, k, rounding_mode="floor")
    source = torch.empty_like(rank).index_copy_(0, rank, row_of_pair)
    rows = x.index_select(0, source)
    with side_stream():
        weights_sorted = torch.empty_like(weights.flatten()).index_copy_(0, rank, weights.flatten()).unsqueeze(-1)
        up = torch._grouped_mm(rows, w3.transpose(1, 2), offs=ends)
    gate = torch._grouped_mm(rows, w1.transpose(1, 2), offs=ends)
    join_side_stream()
    act = ops.moe._weighted_into(weights_sorted, ops.moe._swiglu(gate, up, limit), x.dtype)
    out = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)
    return out.index_select(0, rank).view(b, k, -1).sum(1, dtype=torch.float32)


REAL = {"combiner": chain.combiner, "mix": ops.mhc._mix_logits, "gate": ops.moe.gate_scores,
        "routed": ops.moe.routed_grouped}


def variant(name):
    chain.combiner = five_nodes if "five" in name else REAL["combiner"]
    ops.mhc._mix_logits = mix_swapped if "mix" in name else REAL["mix"]
    ops.moe.gate_scores = gate_swapped if "gate" in name else REAL["gate"]
    ops.moe.routed_grouped = routed_by_ranks if "rank" in name else REAL["routed"]


def main():
    dev = torch.device("cuda", 0)
    cfg = V4Config.flash().replace(max_position_embeddings=4096)
    weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
    ALL = ["combine", "five nodes", "mix fn@x", "gate w@x", "rank routing", "mix+gate+rank", "combine again"]
    CASES = {1: ALL, 8: ["combine", "five nodes", "rank routing", "combine again"],
             32: ["combine", "five nodes", "rank routing", "combine again"]}
    print_variants(cfg, weights, dev, CASES, variant)
    variant("combine")


if __name__ == "__main__":  # ab_combine_fork.py imports five_nodes
    main()
