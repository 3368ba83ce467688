"""(GPU) The FP8 GEMV's variants alone, at the chain's shapes, past a cold L2.

    python benchmarks/probe_fp8_gemv.py [batch1] [dot]

batch1: each row is one variant of ``fp8_linear``'s batch-1 path (note "batch 1 forms": ``BATCH1_FORM``,
``BATCH1_TILE_AHEAD``, the ``BATCH1_CONFIG`` tile), each column one weight shape the draft step
reads at B=1 (e_proj / h_proj, wq_a + wkv, wq_b, wo_a, wo_b): median us over 15 launches, each
after a 512 MB write has flushed the L2 and behind a GPU sleep (so the events time the GPU, not the
host's launch), and the rate in TB/s of the weight's bytes. The outputs of every variant are
checked against form 0's (form 1 bit for bit, the others to fp32 summation order) before timing.

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

    base = fp8_linear.BATCH1_CONFIG
    tiles = {"4x1024 w1": base, "4x512 w1 s6": GemvConfig(4, 512, 1, 6, use_dot=False),
             "8x1024 w2": GemvConfig(8, 1024, 2, 3, use_dot=False), "8x512 w2": GemvConfig(8, 512, 2, 4, use_dot=False),
             "4x2048 w2": GemvConfig(4, 2048, 2, 3, use_dot=False)}  # fmt: skip
    rows = [("form 0", 0, False, "4x1024 w1"), ("form 0", 0, False, "4x512 w1 s6"), ("form 1", 1, False, "4x1024 w1")]
    for tile in tiles:
        rows += [("form 2", 2, False, tile), ("form 2 ahead", 2, True, tile)]
    return [(f"{label} {tile}", form, ahead, tiles[tile]) for label, form, ahead, tile in rows]


def dot_variants():
    from draftgraph.ops.triton.gemv import GemvConfig

    tiles = [(32, 128, 2, 6), (32, 128, 2, 4), (16, 128, 1, 6), (64, 128, 4, 3), (64, 128, 2, 4)]
    return [("config_for", 0, False, None)] + [(f"{n}x{k} w{w} s{s}", 0, False, GemvConfig(n, k, w, s))
                                              for n, k, w, s in tiles]  # fmt: skip


def table(weights, batch: int, rows, flush, events) -> None:
    """One line a variant: us and TB/s at each shape, outputs checked against the first row's."""
    from draftgraph.ops.triton import fp8_linear

    xs = {shape: torch.randn(batch, shape[1], device="cuda").bfloat16() for shape in SHAPES}
    print(f"B={batch}".ljust(28) + "".join(f"{n}x{k}".rjust(20) for n, k in SHAPES), flush=True)
    reference = {}
    for label, form, ahead, fixed in rows:
        fp8_linear.BATCH1_FORM, fp8_linear.BATCH1_TILE_AHEAD = form, ahead
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
            exact = torch.equal(out, ref)
            if form == 1 and cfg is fp8_linear.BATCH1_CONFIG and not exact:
                cells.append(f"NOT EXACT {err:.1e}")
                continue
            if not err < 1e-5:
                cells.append(f"WRONG {err:.1e}")
                continue
            us = timed_cold(events, flush, gemv)
            cells.append(f"{us:6.1f} us {w.numel() / us / 1e6:4.2f}")
        print(label.ljust(28) + "".join(c.rjust(20) for c in cells), flush=True)
    fp8_linear.BATCH1_FORM, fp8_linear.BATCH1_TILE_AHEAD = 0, False


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
