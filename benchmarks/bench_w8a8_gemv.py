"""(GPU) fp8_gemv alone at the V4-Flash FP8 linear shapes: the bf16 dot tiles against W8A8 on the FP8 tensor cores.

    python benchmarks/bench_w8a8_gemv.py [--batches 8,32,64]

fp8_linear's note "W8A8 on the tensor cores": with ``act_fp8`` the activation tile is rounded
through e4m3 in the kernel and multiplied code by code (wgmma on 64- or 128-row tiles; the 32-row
default tiles take mma.sync on converted codes). Each row times one variant on the same
activations, rounded first (``fp8_round_activations``) for the bf16 rows so that every row
computes the same GEMV: µs a launch (20 launches a CUDA graph, median of 10 replays, the weight
rotated over enough copies to miss the L2), % of the weight bytes' copy floor (the copy
bandwidth measured in the run), and the relative error against the default bf16 row
(``ERR`` past 2e-2: a wrong result, not noise). A split row sums its parts in the kernel
(fp8_linear's "split K, reduced").
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch
from bench_floor import measure_copy_bandwidth
from draftgraph.ops.triton import fp8_linear as F
from draftgraph.ops.triton.gemv import GemvConfig
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import fp8_round_activations, quantize_fp8

# name -> (config or None for the code's default, act_fp8, split_k)
VARIANTS = {
    "bf16 default": (None, False, 1),
    "fp8 default": (None, True, 1),
    "fp8 64x128 w4 s4": (GemvConfig(64, 128, 4, 4), True, 1),
    "fp8 64x128 w4 s6": (GemvConfig(64, 128, 4, 6), True, 1),
    "fp8 128x128 w8 s4": (GemvConfig(128, 128, 8, 4), True, 1),
    "fp8 64x128 w4 s4 split 2": (GemvConfig(64, 128, 4, 4), True, 2),
}


def flash_shapes() -> dict[str, tuple[int, int]]:
    """The FP8 linears of the V4-Flash MTP layer, [N, K]."""
    c = V4Config.flash()
    d, hd = c.hidden_size, c.num_attention_heads * c.head_dim
    return {"e_proj / h_proj": (d, d), "wq_b": (hd, c.q_lora_rank), "wo_b": (d, c.o_groups * c.o_lora_rank),
            "shared w1": (c.moe_intermediate_size, d), "wq_a": (c.q_lora_rank, d)}


def time_launch(launch, copies: int) -> float:
    """µs of one launch: 20 a CUDA graph (weight copy i % copies), median of 10 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            launch(i % copies)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(20):
            launch(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / 20)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,64", help="activation rows, e.g. 8,32,64")
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: expected a comma list of ints, got {args.batches!r}")
    if any(b < 1 or b > 64 for b in batches):
        ap.error(f"--batches: expected rows in [1, 64] (fp8_gemv's skinny GEMMs), got {args.batches!r}")
    if not torch.cuda.is_available():
        print("bench_w8a8_gemv.py: expected a CUDA device, got none (hint: run it on a GPU machine)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'linear':<16} {'N x K':>12} {'B':>3}  {'variant':<26} {'us':>7} {'% floor':>7}  error")
    for name, (n, k) in flash_shapes().items():
        q, s = quantize_fp8(torch.randn(n, k, device=dev) / 64)
        nbytes = q.numel() + s.numel()
        copies = max(2, math.ceil(256e6 / nbytes))  # past the L2: every launch reads from DRAM
        weights = [(q.clone(), s.clone()) for _ in range(copies)]
        for b in batches:
            x = (torch.randn(b, k, device=dev) * 3).bfloat16()
            rounded = fp8_round_activations(x)
            ref = None
            for variant, (cfg, act, split) in VARIANTS.items():
                cfg = cfg or F.config_for(b)
                out = torch.empty(b, n, device=dev, dtype=torch.bfloat16)
                kw = dict(config=cfg, act_fp8=act)
                if split > 1:
                    tiles = F.split_tiles(b, n, n, k, cfg, split_k=split)
                    kw.update(split_k=split, split_reduce=(torch.empty(split * b * n, device=dev),
                                                           torch.zeros(tiles, device=dev, dtype=torch.int32)))
                xin = x if act else rounded
                try:
                    us = time_launch(lambda i, xin=xin, out=out, kw=kw, ws=weights: F.fp8_gemv(xin, *ws[i], out, **kw),
                                     copies)
                except Exception as exc:  # report, don't die: the other rows still count
                    print(f"{name:<16} {f'{n}x{k}':>12} {b:>3}  {variant:<26} failed: {type(exc).__name__}: {exc}")
                    continue
                ref = out.float() if ref is None else ref
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                flag = "  ERR" if err > 2e-2 else ""
                print(f"{name:<16} {f'{n}x{k}':>12} {b:>3}  {variant:<26} {us:7.1f} "
                      f"{nbytes / bandwidth * 1e6 / us * 100:6.0f}%  {err:.1e}{flag}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
