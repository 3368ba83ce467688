"""The routed experts' grouped GEMMs at V4-Flash shapes, B=1 (six experts, one row each), on a GPU.

    python benchmarks/h200/scripts/grouped_mm.py

A scratch micro-benchmark kept for the numbers it gave (grouped_mm_1ac9c23.txt): w1 alone,
w1 and w3 in a row, on two streams, merged into one [E, 2I, D] weight, split along K, and w2.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scratch_common import best_in_graph  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
E, INTER, D, K = 256, 2048, 4096, 6
w1 = torch.randn(E, INTER, D, device=dev, dtype=torch.bfloat16) * 0.01
w3 = torch.randn(E, INTER, D, device=dev, dtype=torch.bfloat16) * 0.01
w2 = torch.randn(E, D, INTER, device=dev, dtype=torch.bfloat16) * 0.01
w13 = torch.cat([w1, w3], 1)  # [E, 2I, D]
x = torch.randn(1, D, device=dev, dtype=torch.bfloat16)
idx = torch.randperm(E, device=dev)[:K].view(1, K)
expert, order = torch.sort(idx.flatten(), stable=True)
ends = torch.searchsorted(expert, torch.arange(E, device=dev), right=True, out_int32=True)
rows = x.index_select(0, torch.div(order, K, rounding_mode="floor"))
act = torch.randn(K, INTER, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()

def gm(a, w):
    return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)

def serial():
    gm(rows, w1)
    gm(rows, w3)

def parallel():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gm(rows, w3)
    gm(rows, w1)
    torch.cuda.current_stream().wait_stream(side)

def merged():
    gm(rows, w13)

def ksplit():
    h = D // 2
    a = torch._grouped_mm(rows[:, :h], w1.transpose(1, 2)[:, :h, :], offs=ends)
    b = torch._grouped_mm(rows[:, h:], w1.transpose(1, 2)[:, h:, :], offs=ends)
    a + b

def down():
    gm(act, w2)

def down_ksplit():
    h = INTER // 2
    a = torch._grouped_mm(act[:, :h], w2.transpose(1, 2)[:, :h, :], offs=ends)
    b = torch._grouped_mm(act[:, h:], w2.transpose(1, 2)[:, h:, :], offs=ends)
    a + b

def one_gemv():
    torch.nn.functional.linear(x, w1[0])

ONE = K * INTER * D * 2  # bytes of one projection of the six experts
CASES = [("w1 alone", lambda: gm(rows, w1), ONE), ("w1+w3 serial", serial, 2 * ONE),
         ("w1|w3 two streams", parallel, 2 * ONE), ("w13 merged", merged, 2 * ONE),
         ("w1 k-split x2", ksplit, ONE), ("w2", down, ONE), ("w2 k-split x2", down_ksplit, ONE),
         ("dense 2048x4096 gemv", one_gemv, INTER * D * 2)]
for name, fn, nbytes in CASES:
    try:
        us = best_in_graph(fn)
        print(f"{name:24s} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s", flush=True)
    except Exception as e:
        print(name, "failed", type(e).__name__, str(e)[:200])
# correctness of merged vs separate
g, a, b = gm(rows, w13), gm(rows, w1), gm(rows, w3)
print("merged equal:", torch.equal(g[:, :INTER], a), torch.equal(g[:, INTER:], b))
