"""embed and lm_head against float64 references."""

from __future__ import annotations

import torch
from v4_op_cases import BATCH, CFG, embed_case, gen, lm_head_case, rel_err, run_op

F64 = torch.float64


def ref_lm_head(h, norm_w, head, eps, rows):
    h, norm_w, head = h.to(F64), norm_w.to(F64), head.to(F64)
    normed = norm_w * h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    return normed @ head[:rows].T


def test_embed_gathers_rows():
    inputs, attrs = embed_case(gen(41))
    inputs[0][1] = inputs[0][0]  # a repeated token is fine
    (out,) = run_op("embed", inputs, attrs)
    assert torch.equal(out, inputs[1][inputs[0]])


def test_lm_head_full_vocab_matches_reference():
    inputs, attrs = lm_head_case(gen(42), vocab_rows=0)
    (logits,) = run_op("lm_head", inputs, attrs)
    assert logits.shape == (BATCH, CFG.vocab_size) and logits.dtype == torch.float32
    ref = ref_lm_head(*inputs, attrs["eps"], CFG.vocab_size)
    # The normed hidden is cast back to bf16 before the GEMV (as every spec norm); the rest is fp32.
    assert rel_err(logits, ref) < 5e-3


def test_lm_head_vocab_rows_limits_the_head():
    inputs, attrs = lm_head_case(gen(43), vocab_rows=600)
    (logits,) = run_op("lm_head", inputs, attrs)
    assert logits.shape == (BATCH, 600)
    assert rel_err(logits, ref_lm_head(*inputs, attrs["eps"], 600)) < 5e-3
    inputs[2][600:] = float("nan")  # rows past vocab_rows are never read
    assert torch.isfinite(run_op("lm_head", inputs, attrs)[0]).all()


def test_lm_head_uses_vanilla_norm_weight():
    # "vanilla": y = w * x / rms, not (1 + w) * x / rms.
    inputs, attrs = lm_head_case(gen(44))
    (logits,) = run_op("lm_head", inputs, attrs)
    h, norm_w, head = inputs
    one_plus_w = ref_lm_head(h, 1 + norm_w.double(), head, attrs["eps"], CFG.vocab_size)
    assert rel_err(logits, ref_lm_head(*inputs, attrs["eps"], CFG.vocab_size)) < 5e-3
    assert rel_err(logits, one_plus_w) > 0.3
