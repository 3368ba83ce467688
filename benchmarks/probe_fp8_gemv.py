"""(GPU) The FP8 GEMV's variants alone, at the chain's shapes, past a cold L2.

    python benchmarks/probe_fp8_gemv.py [batch1] [dot]

batch1: each row is one FMA tile of ``fp8_linear``'s batch-1 path (``BATCH1_CONFIG`` first), each
column one weight shape the draft step reads at B=1 (e_proj / h_proj, wq_a + wkv, wq_b, wo_a,
wo_b): median us over 15 launches, each after a 512 MB write has flushed the L2 and behind a GPU
sleep (so the events time the GPU, not the host's launch), and the rate in TB/s of the weight's
bytes. The outputs of every variant are checked against the first row's (to fp32 summation order)
before timing. (The batch-1 forms this table first compared lost on an H100 and were removed:
benchmarks/h200/KERNEL_RUNS.md, "The batch-1 forms, by the SASS, then by the GPU".)

dot: the dot tiles at 8 and 32 activation rows (``config_for``'s choice first): on 4 warps a 32-row
tile puts two warps on each weight row's mma operand, and each decodes it (the sm_90 SASS of the K
loop: 32 codes a thread, 235 instructions, 4 conversions a code; on 2 warps 64 codes, 297, 2 a code).

The chain's own A/B of the winners: ``benchmarks/ab_chain.py``.
"""

from __future__ import annotations

import sys

import torch
from probe_l2_prefetch import fp8_weight, timed_cold, timing_setup

SHAPES = [(4096, 4096), (1536, 4096), (32768, 1024), (8192, 4096), (4096, 8192)]


def variants():
    from draftgraph.ops.triton import fp8_linear
    from draftgraph.ops.triton.gemv import GemvConfig

    tiles = [("4x1024 w1", fp8_linear.BATCH1_CONFIG), ("4x512 w1 s6", GemvConfig(4, 512, 1, 6, use_dot=False)),
             ("8x1024 w2", GemvConfig(8, 1024, 2, 3, use_dot=False)),
             ("8x512 w2", GemvConfig(8, 512, 2, 4, use_dot=False)),
             ("4x2048 w2", GemvConfig(4, 2048, 2, 3, use_dot=False))]  # fmt: skip
    return [(f"fma {label}", cfg) for label, cfg in tiles]


def dot_variants():
    from draftgraph.ops.triton.gemv import GemvConfig

    tiles = [(32, 128, 2, 6), (32, 128, 2, 4), (16, 128, 1, 6), (64, 128, 4, 3), (64, 128, 2, 4)]
    return [("config_for", None)] + [(f"{n}x{k} w{w} s{s}", GemvConfig(n, k, w, s)) for n, k, w, s in tiles]


def table(weights, batch: int, rows, flush, events) -> None:
    """One line a variant: us and TB/s at each shape, outputs checked against the first row's."""
    from draftgraph.ops.triton import fp8_linear

    xs = {shape: torch.randn(batch, shape[1], device="cuda").bfloat16() for shape in SHAPES}
    print(f"B={batch}".ljust(28) + "".join(f"{n}x{k}".rjust(20) for n, k in SHAPES), flush=True)
    reference = {}
    for label, fixed in rows:
        cells = []
        for shape in SHAPES:
            (w, s), x = weights[shape], xs[shape]
            cfg = fixed or fp8_linear.config_for(batch, shape[0])
            out = torch.full((batch, shape[0]), float("nan"), device="cuda")

            def gemv(x=x, w=w, s=s, out=out, cfg=cfg):
                fp8_linear.fp8_gemv(x, w, s, out, config=cfg)

            gemv()
            ref = reference.setdefault(shape, out.clone())
            err = float((out - ref).abs().max() / ref.abs().max())
            if not err < 1e-5:
                cells.append(f"WRONG {err:.1e}")
                continue
            us = timed_cold(events, flush, gemv)
            cells.append(f"{us:6.1f} us {w.numel() / us / 1e6:4.2f}")
        print(label.ljust(28) + "".join(c.rjust(20) for c in cells), flush=True)


def main() -> None:
    what = sys.argv[1:] or ["batch1", "dot"]
    if set(what) - {"batch1", "dot"}:
        print(f"probe_fp8_gemv: expected batch1 and / or dot, got {what}", file=sys.stderr)
        raise SystemExit(2)
    flush, events = timing_setup()
    weights = {shape: fp8_weight(*shape) for shape in SHAPES}
    if "batch1" in what:
        table(weights, 1, variants(), flush, events)
    if "dot" in what:
        for batch in (8, 32):
            table(weights, batch, dot_variants(), flush, events)


if __name__ == "__main__":
    main()
