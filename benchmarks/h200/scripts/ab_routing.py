"""Scratch A/B (H200, V4-Flash shapes, B=1 K=1, torch ops, captured replay us): two small cuts
taken back one at a time, on a tree where both were in.

- "weights inline": the MoE's routing weights on the main stream (kept: on the side lane).
- "masked_fill argmax": the vocab limit applied by an out-of-place masked_fill, against the tried
  torch.where with a scalar -inf (dropped after this run: no gain; main keeps masked_fill).
The tree also read the MoE's B=1 rows by one expand copy instead of an index_select of
order // k (a static branch, not taken back here; dropped: the whole run gained nothing beyond
the weights' 6 us over cb891d0's 844).

    python benchmarks/h200/scripts/ab_routing.py
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from scratch_common import warm_torch_proposer  # noqa: E402

import ops.moe  # noqa: E402
import ops.sampling  # noqa: E402
from ops import registry  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from tools.bench_draft import random_weights, time_replays  # noqa: E402

dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
real_argmax = registry.get_op("draft_argmax")
real_beside = ops.moe._weights_beside


def masked_fill_argmax(inputs, outputs, attrs, workspace):
    logits = inputs[0]
    token, prob = outputs
    b, vocab = logits.shape
    chunks = ops.sampling.vocab_chunks(vocab)
    blocked = ops.sampling.blocked_tokens(vocab, inputs[1], inputs[2] if len(inputs) > 2 else None)
    masked = logits.masked_fill(blocked, float("-inf"))
    chunk_top, chunk_at = masked.view(b, chunks, vocab // chunks).max(-1)
    top, which = chunk_top.max(-1, keepdim=True)
    with ops.sampling.side_stream():
        total = masked.sub_(top).exp_().view(b, chunks, vocab // chunks).sum(-1).sum(-1)
        torch.nan_to_num(total.reciprocal_(), nan=0.0, out=prob)
    torch.add(chunk_at.gather(1, which).squeeze(1), which.squeeze(1), alpha=vocab // chunks, out=token)
    ops.sampling.join_side_stream()


def variant(name):
    ops.moe._weights_beside = (lambda s, i, sc: ops.moe._renormalised(s, i, sc)) if "weights" in name \
        else real_beside
    registry._REGISTRY["draft_argmax"] = dataclasses.replace(real_argmax, impl=masked_fill_argmax) \
        if "masked_fill" in name else real_argmax


first = None
for name in ["current", "weights inline", "masked_fill argmax", "weights inline + masked_fill argmax",
             "current again"]:
    variant(name)
    prop, ex, d = warm_torch_proposer(cfg, weights, dev, 1)
    first = d if first is None else first
    ms, spread = time_replays(ex.replay)
    print(f"B= 1 {name:40s} replay {ms * 1e3:7.1f} us spread {spread:.3f} same drafts {d == first}", flush=True)
    del prop, ex
    torch.cuda.empty_cache()
variant("current")
