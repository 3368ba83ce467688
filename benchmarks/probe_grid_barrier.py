"""(GPU) Could one persistent kernel replace the chain's launches? A grid barrier's cost beside a launch's.

    python benchmarks/probe_grid_barrier.py [--phases 20] [--n 2048] [--rounds 50]

docs/KERNELS.md ("What is left", item 3): at B=1 the chain's ~27 launches before the head cost
~3.5 us each beyond their bytes. A persistent kernel (one program per SM, the steps as phases
with a grid-wide barrier between them) has no launches to ramp but pays a barrier a phase. This
measures both on one GPU, a line each:

- ``barrier``: one, then two programs an SM passing 64 barriers (a global counter, release / acquire
  atomics, a bounded spin) against none: us a barrier;
- ``launch``: ``phases`` tiny kernels in one CUDA graph against one, without and with
  programmatic dependent launch (PDL, as the chain launches): us a launch in a graph;
- ``chain``: ``phases`` dependent GEMVs y[p+1] = W[p] y[p] (bf16 [n, n], distinct weights: 8 MB
  each at n = 2048, as the body's GEMVs) as that many kernels in a graph, without and with PDL,
  and as one persistent kernel of one and of two programs an SM (the latter a program a tile, as
  the separate kernels' grid), without and with an L2 prefetch of each program's next-phase tiles
  before it waits at a barrier: us a chain against the bytes' floor at the copy rate, and the
  outputs equal to the separate kernels' (the same tile function does the math in both forms).

A spin past its bound marks the launch failed (its programs were not all resident) and the
kernel runs on: the line says so instead of the GPU hanging. The barrier and the chain also run
on the CPU under Triton's interpreter (one program; tests/test_probe_grid_barrier.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl
from draftgraph.ops.triton._common import pdl_args, pdl_wait

# Spins of one program at a barrier before it gives up and flags the launch: an acquire load is an
# L2 round trip (under 1 us), so ~50 ms a barrier, 64 barriers in seconds at worst; a co-resident
# grid waits a phase's few microseconds.
MAX_SPIN = 1 << 16
PREFETCH_PTX = ("{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n"
                "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}")
PREFETCH_CHUNK = 16384  # bytes a lane asks the L2 for (probe_l2_prefetch.py's bulk form)


@triton.jit
def _barrier(counter, target, failed, MAX_SPIN: tl.constexpr):
    """Arrive at ``counter`` and wait for ``target`` arrivals: every store before it is seen by every
    load after it in any program (release on arrival, acquire on each read)."""
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    spins = seen * 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= MAX_SPIN:
        tl.atomic_xchg(failed, 1)


@triton.jit
def _barriers_kernel(counter, failed, num_barriers, MAX_SPIN: tl.constexpr):
    g = tl.num_programs(0)
    for b in range(num_barriers):
        _barrier(counter, (b + 1) * g, failed, MAX_SPIN)


@triton.jit
def _tiny_kernel(out, PDL: tl.constexpr):
    pdl_wait(PDL)
    tl.store(out + tl.program_id(0), tl.program_id(0))


@triton.jit
def _gemv_tile(w, x, y, tile, n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[rows] = w[rows, :] @ x for the BLOCK_N rows of ``tile`` (w bf16 [n, n], x and y fp32 [n])."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        acc += tl.sum(tl.load(w + rows[:, None] * n + cols[None, :]).to(tl.float32) * tl.load(x + cols)[None, :], 1)
    tl.store(y + rows, acc)


@triton.jit
def _gemv_kernel(w, x, y, n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    _gemv_tile(w, x, y, tl.program_id(0), n, BLOCK_N, BLOCK_K)


@triton.jit
def _prefetch_l2(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, PTX: tl.constexpr):
    """Ask the L2 for ``nbytes`` from ``base``, a lane a chunk (a hint: no value changes)."""
    offs = tl.arange(0, LANES).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK)
    size = (tl.where(size > 0, size, 0) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(PTX, "=r,l,r", [base.to(tl.pointer_type(tl.uint8)) + offs, size], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _persistent_chain_kernel(w, ys, counter, failed, n, phases, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PREFETCH: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr, PTX: tl.constexpr,
                             MAX_SPIN: tl.constexpr):
    """The chain's phases in one launch: each program takes tiles pid, pid + G, ... of a phase, then
    waits at the barrier for every program's tiles (the next phase reads all of y)."""
    pid, g = tl.program_id(0), tl.num_programs(0)
    tiles = n // BLOCK_N
    for p in range(phases):
        for tile in range(pid, tiles, g):
            _gemv_tile(w + p * n * n, ys + p * n, ys + (p + 1) * n, tile, n, BLOCK_N, BLOCK_K)
        if PREFETCH:  # the next phase's weights do not depend on this phase: in flight across the barrier
            if p + 1 < phases:
                for tile in range(pid, tiles, g):
                    _prefetch_l2(w + (p + 1) * n * n + tile * BLOCK_N * n, BLOCK_N * n * 2, CHUNK, LANES, PTX)
        _barrier(counter, (p + 1) * g, failed, MAX_SPIN)


def make_chain(phases: int, n: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [phases, n, n] bf16 (scaled to keep y's size) and ys [phases + 1, n] fp32, ys[0] the input."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(phases, n, n, generator=gen) / n**0.5).to(torch.bfloat16).to(device)
    ys = torch.zeros(phases + 1, n, dtype=torch.float32, device=device)
    ys[0] = torch.randn(n, generator=gen).to(device)
    return w, ys


def run_separate(w: torch.Tensor, ys: torch.Tensor, block_n: int = 8, block_k: int = 256, pdl: bool = False):
    """The chain as one kernel launch a phase."""
    phases, n = w.shape[0], w.shape[1]
    options = pdl_args(w.device) if pdl else {"PDL": False}
    for p in range(phases):
        _gemv_kernel[(n // block_n,)](w[p], ys[p], ys[p + 1], n, BLOCK_N=block_n, BLOCK_K=block_k, **options)


def run_persistent(w: torch.Tensor, ys: torch.Tensor, counter: torch.Tensor, failed: torch.Tensor, grid: int,
                   block_n: int = 8, block_k: int = 256, prefetch: bool = False, max_spin: int = MAX_SPIN):
    """The chain as one launch of ``grid`` programs (all resident at once, or the barrier cannot pass: the
    bounded spin flags it)."""
    phases, n = w.shape[0], w.shape[1]
    lanes = triton.next_power_of_2(triton.cdiv(block_n * n * 2, PREFETCH_CHUNK))
    counter.zero_()
    _persistent_chain_kernel[(grid,)](w, ys, counter, failed, n, phases, BLOCK_N=block_n, BLOCK_K=block_k,
                                      PREFETCH=prefetch, CHUNK=PREFETCH_CHUNK, LANES=lanes, PTX=PREFETCH_PTX,
                                      MAX_SPIN=max_spin)


def run_barriers(counter: torch.Tensor, failed: torch.Tensor, grid: int, count: int, max_spin: int = MAX_SPIN):
    counter.zero_()
    _barriers_kernel[(grid,)](counter, failed, count, MAX_SPIN=max_spin)


def _graph_of(launch) -> torch.cuda.CUDAGraph:
    launch()  # compiles, and a first run off the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, rounds: int) -> float:
    """Median us of one replay; a GPU sleep queued first, so the events time the GPU, not the host."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(100_000)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", type=int, default=20)
    ap.add_argument("--n", type=int, default=2048, help="each GEMV's rows and columns (a multiple of 256)")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args(argv)
    for flag, value, ok, want in (("--phases", args.phases, args.phases >= 2, "an int >= 2"),
                                  ("--n", args.n, args.n >= 256 and args.n % 256 == 0, "a multiple of 256"),
                                  ("--rounds", args.rounds, args.rounds >= 1, "an int >= 1")):
        if not ok:
            print(f"probe_grid_barrier.py: {flag}: expected {want}, got {value}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("probe_grid_barrier.py: expected a CUDA device, got none (hint: run it on a GPU machine; the CPU "
              "tests run its kernels under Triton's interpreter)", file=sys.stderr)
        return 2
    from bench_floor import measure_copy_bandwidth

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    counter, failed = (torch.zeros(1, dtype=torch.int32, device=device) for _ in range(2))

    for per_sm in (1, 2):
        failed.zero_()
        grid = per_sm * sms
        none = _replay_us(_graph_of(lambda grid=grid: run_barriers(counter, failed, grid, 0)), args.rounds)
        many = _replay_us(_graph_of(lambda grid=grid: run_barriers(counter, failed, grid, 64)), args.rounds)
        print(f"barrier, {per_sm} an SM: {(many - none) / 64:.2f} us a barrier (64 in {many:.1f} us, none {none:.1f})"
              + ("  FAILED: a spin ran past its bound" if failed.item() else ""))

    out = torch.zeros(sms, dtype=torch.int32, device=device)
    for pdl in (False, True):
        options = pdl_args(device) if pdl else {"PDL": False}
        def tiny(count, options=options):
            for _ in range(count):
                _tiny_kernel[(sms,)](out, **options)

        one = _replay_us(_graph_of(lambda: tiny(1)), args.rounds)
        chain = _replay_us(_graph_of(lambda: tiny(args.phases)), args.rounds)
        print(f"launch{' (PDL)' if pdl else ''}: {(chain - one) / (args.phases - 1):.2f} us a launch in a graph "
              f"({args.phases} in {chain:.1f} us, one {one:.1f})")

    w, ys = make_chain(args.phases, args.n, device)
    floor = w.numel() * w.element_size() / measure_copy_bandwidth(device) * 1e6
    print(f"chain: {args.phases} GEMVs of bf16 [{args.n}, {args.n}], {w.numel() * 2 / 1e6:.0f} MB, "
          f"floor {floor:.1f} us")
    variants = {
        "kernels": lambda: run_separate(w, ys),
        "kernels (PDL)": lambda: run_separate(w, ys, pdl=True),
        "persistent": lambda: run_persistent(w, ys, counter, failed, sms),
        "persistent, next phase to L2": lambda: run_persistent(w, ys, counter, failed, sms, prefetch=True),
        # Two programs an SM (co-resident: 4 warps each): a program a tile at n = 2048, the bytes in
        # flight of the separate kernels' 256 programs, where one an SM runs two tiles in turn.
        "persistent, 2 an SM": lambda: run_persistent(w, ys, counter, failed, 2 * sms),
        "persistent, 2 an SM, next to L2": lambda: run_persistent(w, ys, counter, failed, 2 * sms, prefetch=True),
    }
    reference = None
    for name, launch in variants.items():
        failed.zero_()
        ys[1:].zero_()
        us = _replay_us(_graph_of(launch), args.rounds)
        result = ys[-1].clone()
        if reference is None:
            reference = result
        same = "equal" if torch.equal(result, reference) else f"DIFFER by {(result - reference).abs().max().item():.3g}"
        print(f"  {name:<30} {us:7.1f} us  {us / floor:5.2f}x floor  {(us - floor) / args.phases:5.2f} us a phase "
              f"over it  outputs {same}" + ("  FAILED: a spin ran past its bound" if failed.item() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
