"""bf16, FP8 and MXFP4 checkpoints of the same weights give the same draft step within
quantisation error: the hidden is close, and the drafts agree wherever the float64
reference (on the unquantised weights) has a top-2 gap wider than the quantisation noise."""

from __future__ import annotations

import torch
from draftgraph.runtime.model.checkpoint_writer import write_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from reference_v4 import ReferenceMtp

CFG = V4Config.small()
ROWS = 64


def test_formats_give_the_same_draft_step(tmp_path):
    weights = random_mtp_weights(CFG, seed=9)
    for fmt in ("bf16", "fp8", "mxfp4"):
        write_checkpoint(tmp_path / fmt, CFG, weights, fmt=fmt)
    gen = torch.Generator().manual_seed(0)
    hiddens = [torch.randn(CFG.hc_mult, CFG.hidden_size, generator=gen).bfloat16() for _ in range(ROWS)]
    tokens = torch.randint(CFG.vocab_size, (ROWS,), generator=gen).tolist()
    positions = [3 + 2 * i for i in range(ROWS)]
    gaps = []
    for token, hidden, position in zip(tokens, hiddens, positions):
        logits, _ = ReferenceMtp(CFG, weights).step(token, hidden.double(), position)
        top = torch.topk(logits, 2)
        gaps.append((float(top.values[0] - top.values[1]), int(top.indices[0])))
    results = {}
    for fmt in ("bf16", "fp8", "mxfp4"):
        prop = DeepseekV4MtpProposer.from_checkpoint(tmp_path / fmt, executor="eager")
        states = [prop.alloc_state() for _ in range(ROWS)]
        drafts = prop.propose_batch(tokens, hiddens, positions, 1, states)
        results[fmt] = ([d[0] for d in drafts], prop.last_hidden(ROWS).double())
    base = results["bf16"][1]
    # Per row, then the median: a row whose MoE top-k flips under quantisation noise (a legitimate
    # discontinuity of routing) differs by far more than the weights do.
    errors = {
        fmt: float(((h - base).flatten(1).norm(dim=1) / base.flatten(1).norm(dim=1)).median())
        for fmt, (_, h) in results.items()
    }
    assert errors["bf16"] == 0
    # ~2.7% per FP8 tensor (e4m3, 128x128 scales) and ~12% per MXFP4 expert, compounded over the step
    assert 0 < errors["fp8"] < 0.1 and errors["fp8"] < errors["mxfp4"] < 0.2, errors
    for fmt, noise in (("bf16", 0.06), ("fp8", 0.5), ("mxfp4", 0.8)):
        checked = 0
        for draft, (gap, best) in zip(results[fmt][0], gaps):
            if gap > noise:
                assert draft == best, (fmt, draft, best, gap)
                checked += 1
        assert checked >= 1, (fmt, gaps)
