"""The torch ops' small-batch projections in three forms, on a GPU: which cuBLAS kernel streams best.

    python benchmarks/h200/scripts/gemv_forms.py

A scratch micro-benchmark kept for the numbers it gave (gemv_forms_*.txt). For each V4-Flash
weight [N, K] bf16 and M input rows: x @ w^T (today's form: torch.mm(x, w.t())), the transposed
problem w @ x^T (its [N, M] output is the same bytes as [M, N] when M = 1), and torch.mv (M = 1).
Each case 20 per CUDA graph, best of 5 rounds; the outputs compared with today's.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scratch_common import best_in_graph  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
SHAPES = [  # (name, N, K)
    ("e_proj / h_proj", 4096, 4096),
    ("wq_a", 1024, 4096),
    ("wq_b", 32768, 1024),
    ("wkv", 512, 4096),
    ("wo_b", 4096, 8192),
    ("shared w1 / w3", 2048, 4096),
    ("shared w2", 4096, 2048),
]


for name, n, k in SHAPES:
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    for m in (1, 4):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        out_t = torch.empty(n, m, device=dev, dtype=torch.bfloat16)
        forms = {
            "x @ w^T": lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out),
            "w @ x^T": lambda x=x, w=w, out_t=out_t: torch.mm(w, x.t(), out=out_t),
        }
        if m == 1:
            forms["mv"] = lambda x=x, w=w, out=out: torch.mv(w, x[0], out=out[0])
        ref = torch.mm(x, w.t())
        line = [f"{name:16s} M={m} {n * k * 2 / 1e6:6.1f} MB"]
        for form, fn in forms.items():
            us = best_in_graph(fn)
            fn()
            got = out_t.t() if form == "w @ x^T" else out
            diff = (got.float() - ref.float()).abs().max().item()
            line.append(f"{form} {us:6.1f} us {n * k * 2 / us / 1e6:4.2f} TB/s (diff {diff:.2g})")
        print(" | ".join(line), flush=True)
