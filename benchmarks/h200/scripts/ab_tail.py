"""Scratch A/B (H200, V4-Flash shapes, torch ops, captured replay us): two one-kernel cuts on the
chain's serial parts, each put in by replacing the registered OpDef's impl, and the kernel
timeline of a replay of the chain as it is and with both.

- "topk unsorted": the MoE's top-k without its sort of the k winners (torch.topk sorted=False,
  one bitonic-sort kernel less; the experts are sorted by id right after anyway). The sum over k
  then adds in another order: the same drafts are not expected bit for bit.
- "where": draft_argmax's mask as one torch.where(blocked, -inf, logits) instead of a clone and
  a masked_fill (two kernels).

    python benchmarks/h200/scripts/ab_tail.py OUT_DIR

Run on d28d096 (ab_tail_d28d096.txt); the MoE variant has since followed ops.moe's API.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from scratch_common import print_variants  # noqa: E402

import ops.moe  # noqa: E402
import ops.sampling as sampling  # noqa: E402
from ops.overlap import join_side_stream, side_stream  # noqa: E402
from ops.registry import get_op  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from tools.bench_draft import random_weights  # noqa: E402


def moe_topk_unsorted(inputs, outputs, attrs, workspace):
    x, gate_w, gate_bias, w1, w2, w3, sw1, sw2, sw3 = inputs
    ops.moe.shared_expert_into(x, sw1, sw2, sw3, float(attrs["swiglu_limit"]), outputs[0])
    scores = ops.moe.gate_scores(x, gate_w)
    idx = torch.topk(scores + gate_bias, int(attrs["top_k"]), dim=-1, sorted=False).indices
    weights = ops.moe._weights_beside(scores, idx, float(attrs["routed_scaling_factor"]))
    ops.moe._experts_into((x, w1, w2, w3), idx, weights, attrs, outputs[0])


def argmax_where(inputs, outputs, attrs, workspace):
    logits = inputs[0]
    token, prob = outputs
    b, vocab = logits.shape
    chunks = sampling.vocab_chunks(vocab)
    blocked = sampling.blocked_tokens(vocab, inputs[1], inputs[2] if len(inputs) > 2 else None)
    masked = torch.where(blocked, float("-inf"), logits)
    chunk_top, chunk_at = masked.view(b, chunks, vocab // chunks).max(-1)
    top, which = chunk_top.max(-1, keepdim=True)
    with side_stream():
        total = masked.sub_(top).exp_().view(b, chunks, vocab // chunks).sum(-1).sum(-1)
        torch.nan_to_num(total.reciprocal_(), nan=0.0, out=prob)
    torch.add(chunk_at.gather(1, which).squeeze(1), which.squeeze(1), alpha=vocab // chunks, out=token)
    join_side_stream()


REAL = {"moe": get_op("moe").impl, "draft_argmax": get_op("draft_argmax").impl}


def variant(name):
    object.__setattr__(get_op("moe"), "impl", moe_topk_unsorted if "unsorted" in name or "both" in name
                       else REAL["moe"])
    object.__setattr__(get_op("draft_argmax"), "impl", argmax_where if "where" in name or "both" in name
                       else REAL["draft_argmax"])


out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
CASES = {1: ["base", "topk unsorted", "where", "both", "base again", "both again"], 32: ["base", "both"]}
print_variants(cfg, weights, dev, CASES, variant, width=20, repeats=2, traced=("base", "both"), out_dir=out_dir)
variant("base")
