"""Draft agreement of a quantised LM head with the bf16 head, at V4-Flash head shapes, on CPU.

    python benchmarks/bench_head_agreement.py [--rows 256] [--vocab 129280] [--dim 4096] [--formats fp8 mxfp4]

Random normal hidden rows go through the final RMS norm and a random bf16 head [V, D] with std
1/sqrt(D) (logits ~ N(0, 1), as a real head's scale gives), then through the same head quantised
(``fp8``: what ``ProposerOptions.head_dtype="fp8"`` binds, runtime/proposer/binding.quantise_head;
``mxfp4``: e2m1 with 1x32 UE8M0 scales, for comparison only). Both logits come from the lm_head
torch op (ops/lm_head.py, fp32). Prints, per format, the fraction of rows whose argmax (the greedy
draft) is the bf16 head's, the logit change, and the bf16 top-2 gaps of the rows that differ.

Random logits are a hard case: 129,280 iid N(0, 1) values have a median top-2 gap near 0.2, far
narrower than a trained model's confident rows. Memory: the bf16 head (1.06 GB) plus a quantised copy.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from draftgraph.ops.lm_head import _lm_head_impl
from draftgraph.runtime.model.quant import QuantWeight, quantize_mxfp4
from draftgraph.runtime.proposer.binding import quantise_head

EPS = 1e-6
QUANT_CHUNK_ROWS = 8192


def mxfp4_head(head: torch.Tensor) -> QuantWeight:
    """The head as MXFP4, quantised a chunk of rows at a time (no fp32 copy of the whole head)."""
    parts = [quantize_mxfp4(head[s : s + QUANT_CHUNK_ROWS]) for s in range(0, head.shape[0], QUANT_CHUNK_ROWS)]
    data = torch.cat([p for p, _ in parts]).view(torch.float4_e2m1fn_x2)
    scale = torch.cat([s.view(torch.uint8) for _, s in parts]).view(torch.float8_e8m0fnu)
    return QuantWeight(data, scale, "mxfp4")


def logits_of(h: torch.Tensor, norm_w: torch.Tensor, head) -> torch.Tensor:
    out = torch.empty(h.shape[0], head.shape[0], dtype=torch.float32)  # [B, V]
    _lm_head_impl([h, norm_w, head], [out], {"eps": EPS, "vocab_rows": 0}, None)
    return out


def quantiles(t: torch.Tensor) -> str:
    if t.numel() == 0:
        return "-"
    q = torch.quantile(t.double(), torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64))
    return "min {:.4f} median {:.4f} p90 {:.4f} max {:.4f}".format(*q.tolist())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="+", default=["fp8"], choices=["fp8", "mxfp4"])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    head = torch.empty(args.vocab, args.dim, dtype=torch.bfloat16)  # [V, D], filled a chunk at a time
    for s in range(0, args.vocab, QUANT_CHUNK_ROWS):
        rows = min(QUANT_CHUNK_ROWS, args.vocab - s)
        head[s : s + rows] = (torch.randn(rows, args.dim, generator=gen) / math.sqrt(args.dim)).bfloat16()
    h = torch.randn(args.rows, args.dim, generator=gen).bfloat16()  # [B, D]
    norm_w = torch.ones(args.dim, dtype=torch.bfloat16)
    start = time.perf_counter()
    base = logits_of(h, norm_w, head)
    top = torch.topk(base, 2).values
    gap = top[:, 0] - top[:, 1]
    print(f"head bf16[{args.vocab},{args.dim}] std 1/sqrt(D), {args.rows} random rows, seed {args.seed}: "
          f"logits std {float(base.std()):.3f}; bf16 top-2 gap {quantiles(gap)} ({time.perf_counter() - start:.1f} s)")
    for fmt in args.formats:
        start = time.perf_counter()
        q = quantise_head(head) if fmt == "fp8" else mxfp4_head(head)
        got = logits_of(h, norm_w, q)
        change = (got - base).abs()  # [B, V]
        same = got.argmax(dim=1) == base.argmax(dim=1)
        differ = ~same
        print(f"{fmt:>5}: {q.nbytes / 1e9:.3f} GB (bf16 {head.numel() * 2 / 1e9:.3f} GB); argmax equal "
              f"{int(same.sum())}/{args.rows} = {float(same.float().mean()):.4f}; |d logit| rms "
              f"{float(change.pow(2).mean().sqrt()):.4f}, per-row max {quantiles(change.amax(dim=1))}; "
              f"bf16 top-2 gap where they differ: {quantiles(gap[differ])}; rows with gap > 2 * row max |d|: "
              f"{int((gap > 2 * change.amax(dim=1)).sum())}, of them differing: "
              f"{int((differ & (gap > 2 * change.amax(dim=1))).sum())} ({time.perf_counter() - start:.1f} s)")
        del q, got, change
    return 0


if __name__ == "__main__":
    sys.exit(main())
