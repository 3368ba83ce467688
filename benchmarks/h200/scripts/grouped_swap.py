# ruff: noqa: B023, E501
"""The routed experts' grouped GEMMs with the operands swapped, on a GPU.

    python benchmarks/h200/scripts/grouped_swap.py

A scratch micro-benchmark kept for the numbers it gave (grouped_swap_*.txt). The current form
is rows [N, D] @ w^T per group (2D x 3D, groups along M): at N of a few rows per expert every
group is one M tile of weights' N columns. Swapped, it is w [E, I, D] @ rows^T (3D x 2D, groups
along N): the weight rows become the M tiles. Same bytes, other tiles. B=1, 8, 32 at top-6 of
256 experts, V4-Flash shapes; each case 20 per CUDA graph, best of 5 rounds; results compared.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scratch_common import best_in_graph  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
E, INTER, D, TOPK = 256, 2048, 4096, 6
w1 = torch.randn(E, INTER, D, device=dev, dtype=torch.bfloat16) * 0.01
w3 = torch.randn(E, INTER, D, device=dev, dtype=torch.bfloat16) * 0.01
w2 = torch.randn(E, D, INTER, device=dev, dtype=torch.bfloat16) * 0.01
side = torch.cuda.Stream()


for batch in (1, 8, 32):
    x = torch.randn(batch, D, device=dev, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device=dev)[:TOPK] for _ in range(batch)])
    expert, order = torch.sort(idx.flatten(), stable=True)
    ends = torch.searchsorted(expert, torch.arange(E, device=dev), right=True, out_int32=True)
    rows = x.index_select(0, torch.div(order, TOPK, rounding_mode="floor"))
    act = torch.randn(rows.shape[0], INTER, device=dev, dtype=torch.bfloat16)
    chosen = torch.unique(idx).numel()
    # Swapped, a group's output columns start at its offset: each must be a multiple of 8
    # (16 bytes), so every group is padded up to 8 rows (the pads are zeros, their outputs dropped).
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    pends = torch.cumsum((counts + 7) // 8 * 8, 0, dtype=torch.int32)
    n = rows.shape[0]
    rank = torch.arange(n, device=dev) - (ends - counts).long()[expert]
    place = (pends - (counts + 7) // 8 * 8).long()[expert] + rank  # [N] padded column of each pair
    padded_n = -(-(n + 7 * min(n, E)) // 8) * 8
    prows = rows.new_zeros(padded_n, D).index_copy_(0, place, rows)
    pact = act.new_zeros(padded_n, INTER).index_copy_(0, place, act)

    def gm(a, w, ends=ends):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)

    def sw(w, a, ends=pends):
        return torch._grouped_mm(w, a.t(), offs=ends)

    def two(f):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                f(w3)
            f(w1)
            torch.cuda.current_stream().wait_stream(side)
        return run

    one = chosen * INTER * D * 2
    cases = [
        ("w1 rows@w^T", lambda: gm(rows, w1), one),
        ("w1 swapped w@rows^T", lambda: sw(w1, prows), one),
        ("w1|w3 rows@w^T 2 streams", two(lambda w: gm(rows, w)), 2 * one),
        ("w1|w3 swapped 2 streams", two(lambda w: sw(w, prows)), 2 * one),
        ("w2 act@w^T", lambda: gm(act, w2), one),
        ("w2 swapped", lambda: sw(w2, pact), one),
    ]
    print(f"B={batch} rows={rows.shape[0]} experts={chosen}", flush=True)
    for name, fn, nbytes in cases:
        try:
            us = best_in_graph(fn)
            print(f"  {name:28s} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s", flush=True)
        except Exception as e:  # noqa: BLE001 - a scratch script reports and goes on
            print(f"  {name:28s} failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    try:
        for name, a, b in (("w1", gm(rows, w1), sw(w1, prows).t()[place]), ("w2", gm(act, w2), sw(w2, pact).t()[place])):
            print(f"  {name}: equal {torch.equal(a, b)}, max diff {(a.float() - b.float()).abs().max().item():.3g}",
                  flush=True)
    except Exception as e:  # noqa: BLE001
        print("  compare failed", type(e).__name__, str(e)[:200], flush=True)
