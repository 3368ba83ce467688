"""(GPU) Weights asked of the L2 ahead of the GEMV that reads them: does a side-branch prefetch pay?

    python benchmarks/probe_l2_prefetch.py micro        # one FP8 GEMV, cold and after a prefetch, by lead time
    python benchmarks/probe_l2_prefetch.py tiles        # batch-1 GEMV tiles, cold and with the weights in the L2
    python benchmarks/probe_l2_prefetch.py floor        # the same bytes read by a plain kernel, a copy, the bf16 GEMV
    python benchmarks/probe_l2_prefetch.py chain PLAN [bulk|line] -- BENCH_DRAFT_ARGS
    python benchmarks/probe_l2_prefetch.py chain off -- BENCH_DRAFT_ARGS

Why: at B=1 the chain spends ~60 us in latency-bound kernels (the hc mixes, the Sinkhorn, the
attention core, the routing) while the DRAM idles, and its FP8 GEMVs run at about half the copy
rate. If the GEMVs were bound by DRAM, the bytes of the next GEMV could be fetched into the L2
during those kernels by a kernel on a side branch of the captured graph, off the chain's path.

- ``micro``: fp8_gemv on a 33.6 MB weight (wo_a's and wq_b's shapes) after a 512 MB write has
  flushed the L2, with and without a prefetch launched ``lead`` us (a GPU sleep) before it. A GPU
  sleep is queued ahead of every round so that the events time the GPU, not the host's launches.
- ``tiles``: the batch-1 FMA tiles (and the dot tiles at 4, 8, 32 rows) cold and warm (the weight
  prefetched 40 us ahead), with the e4m3 codes converted by the hardware and by integer ops: a tile
  that is no faster warm is not waiting on DRAM.
- ``floor``: the same 33.6 MB read by a kernel that only folds its words, by torch's copy, and by
  the bf16 GEMV on the head's tiles: what a launch of this size can reach, cold and warm.
- ``chain``: bench_draft with the captured chain's steps forking a prefetch at the latency-bound
  steps named in ``PLANS`` (each: the step to fork at, the step whose weights to fetch, a byte
  budget taken in its inputs' order; stacked routed experts skipped: their ids are not known yet).
  Processes alternated on / off give the A/B.

The prefetch kernel gives each thread one chunk: ``cp.async.bulk.prefetch.L2`` (sm90) of 16 or
64 KB, or ``prefetch.global.L2`` of one 128-byte line. Both are hints: no value changes.
Results: benchmarks/h200/l2_prefetch_side_branch_42cb8f9_h100_log.txt, benchmarks/h200/KERNEL_RUNS.md
("Twenty-third device runs").
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl
from bench_knobs import run_bench_draft

BULK_PTX = "{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}"
LINE_PTX = "{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n@p prefetch.global.L2 [$1];\nmov.u32 $0, 0;\n}"
CYCLES_PER_US = 1800  # torch.cuda._sleep's unit; measured 20 us -> 21.2-21.6 on an H100 at 1980 MHz

# fork at step -> (the step whose weights to fetch, MB of them)
PLANS = {
    "a": {"rows_at": ("d0.combiner", 40), "d0.body.hc_pre_attn": ("d0.body.attn", 40),
          "d0.body.hc_post_attn": ("d0.body.moe", 40), "d0.body.hc_post_ffn": ("d0.lm_head", 40)},
    "attn": {"d0.body.hc_pre_attn": ("d0.body.attn", 40)},
    "head": {"d0.body.hc_post_ffn": ("d0.lm_head", 40)},
    "moe": {"d0.body.hc_post_attn": ("d0.body.moe", 40)},
}


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, T: tl.constexpr, PTX: tl.constexpr):
    """Thread i of program p asks the L2 for chunk p * T + i (its size rounded down to 16)."""
    offs = (tl.program_id(0) * T + tl.arange(0, T)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK)
    size = (tl.where(size > 0, size, 0) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(PTX, "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, nbytes: int | None = None, mode: str = "bulk", chunk: int = 16384,
             warps: int = 1) -> None:
    """Ask the L2 for the first ``nbytes`` of ``t`` (all of it by default)."""
    data = t.reshape(-1).view(torch.uint8)
    n = data.numel() if nbytes is None else min(nbytes, data.numel())
    lanes, ptx = 32 * warps, BULK_PTX
    if mode == "line":
        chunk, ptx = 128, LINE_PTX
    _prefetch_kernel[(triton.cdiv(n, lanes * chunk),)](data, n, CHUNK=chunk, T=lanes, PTX=ptx, num_warps=warps)


def fp8_weight(n: int, k: int):
    """A random [n, k] weight in FP8 with its block scales, on the GPU."""
    from draftgraph.runtime.model.quant import quantize_fp8

    return quantize_fp8(torch.randn(n, k, device="cuda") * 0.02)


def timing_setup() -> tuple[torch.Tensor, list[torch.cuda.Event]]:
    """A 512 MB buffer whose write flushes the L2, two events, and the device's name printed."""
    print(torch.cuda.get_device_name(), flush=True)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    return flush, [torch.cuda.Event(enable_timing=True) for _ in range(2)]


def timed_cold(events, flush: torch.Tensor, launch, before=None) -> float:
    """Median us of ``launch`` over 15 rounds, each after an L2 flush and ``before`` (the prefetch)."""
    times = []
    for _ in range(15):
        flush.zero_()
        torch.cuda._sleep(300_000)  # the host queues the round while the GPU waits here
        if before is not None:
            before()
        events[0].record()
        launch()
        events[1].record()
        torch.cuda.synchronize()
        times.append(events[0].elapsed_time(events[1]) * 1e3)
    return statistics.median(times)


def micro() -> None:
    from draftgraph.ops.triton import fp8_linear

    flush, events = timing_setup()
    for n, k in [(8192, 4096), (32768, 1024)]:
        w, s = fp8_weight(n, k)
        x = torch.randn(1, k, device="cuda").bfloat16()
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

        def gemv(x=x, w=w, s=s, out=out, n=n):
            fp8_linear.fp8_gemv(x, w, s, out, config=fp8_linear.config_for(1, n))

        print(f"W [{n}, {k}] fp8 {w.numel() / 1e6:.1f} MB: GEMV us cold, then after a prefetch launched lead us ahead")
        print(f"  cold {timed_cold(events, flush, gemv):6.1f}")
        for mode, chunk in [("bulk", 16384), ("bulk", 65536), ("line", 128)]:
            for lead in (0, 10, 20, 40):
                def ahead(w=w, mode=mode, chunk=chunk, lead=lead):
                    prefetch(w, mode=mode, chunk=chunk)
                    if lead:
                        torch.cuda._sleep(lead * CYCLES_PER_US)

                print(f"  {mode} {chunk:>6} B lead {lead:>2} {timed_cold(events, flush, gemv, ahead):6.1f}", flush=True)


def tiles() -> None:
    from draftgraph.ops.triton import fp8_linear
    from draftgraph.ops.triton.gemv import GemvConfig

    flush, events = timing_setup()
    fma = [(4, 1024, 1, 4), (4, 1024, 1, 6), (4, 512, 1, 6), (8, 512, 1, 4), (2, 1024, 1, 4), (4, 2048, 2, 3),
           (16, 256, 4, 4), (8, 1024, 2, 3)]
    for n, k in [(8192, 4096), (32768, 1024)]:
        w, s = fp8_weight(n, k)
        cases = [(1, fp8_linear.BATCH1_CONFIG)] + [(1, GemvConfig(*c, use_dot=False)) for c in fma]
        cases += [(b, fp8_linear.config_for(b, n)) for b in (4, 8, 32)]
        print(f"W [{n}, {k}] fp8 {w.numel() / 1e6:.1f} MB: us cold / warm (prefetched 40 us ahead)", flush=True)
        for b, cfg in cases:
            x = torch.randn(b, k, device="cuda").bfloat16()
            out = torch.empty(b, n, device="cuda", dtype=torch.bfloat16)
            cells = []
            for native in (True, False):
                def gemv(x=x, out=out, cfg=cfg, native=native, w=w, s=s):
                    fp8_linear.fp8_gemv(x, w, s, out, config=cfg, native_fp8=native)

                try:
                    gemv()
                except Exception as exc:  # noqa: BLE001 - a tile the kernel refuses: named in the row
                    cells.append(type(exc).__name__)
                    continue

                def ahead(w=w):
                    prefetch(w, mode="bulk", chunk=65536)
                    torch.cuda._sleep(40 * CYCLES_PER_US)

                cells.append(f"{timed_cold(events, flush, gemv):6.1f} / {timed_cold(events, flush, gemv, ahead):6.1f}")
            kind = "dot" if cfg.use_dot else "fma"
            print(f"  B={b:<2} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {kind}: "
                  f"hardware cvt {cells[0]}   integer decode {cells[1]}", flush=True)


@triton.jit
def _read_kernel(src, out, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Read STEPS blocks of BLOCK int32 words (XOR-folded, one store a program): the read floor."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + tl.program_id(0), tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def floor() -> None:
    """What reading 33.6 MB costs without a GEMV's work: a plain read kernel, torch's copy, the bf16 GEMV."""
    from draftgraph.ops.triton import gemv as gemv_mod

    flush, events = timing_setup()
    data = torch.randint(0, 255, (8192 * 4096,), dtype=torch.uint8, device="cuda")
    words = data.view(torch.int32)
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")

    def ahead():
        prefetch(data, mode="bulk", chunk=65536)
        torch.cuda._sleep(40 * CYCLES_PER_US)

    print(f"{data.numel() / 1e6:.1f} MB: us cold / warm (prefetched 40 us ahead)")
    for block, steps, warps in [(1024, 1, 4), (1024, 4, 4), (2048, 4, 8), (4096, 2, 8), (1024, 16, 4)]:
        grid = triton.cdiv(words.numel(), block * steps)

        def read(block=block, steps=steps, warps=warps, grid=grid):
            _read_kernel[(grid,)](words, out, words.numel(), BLOCK=block, STEPS=steps, num_warps=warps)

        read()
        print(f"  read kernel {block} x {steps} words a program, {warps} warps, {grid} programs: "
              f"{timed_cold(events, flush, read):6.1f} / {timed_cold(events, flush, read, ahead):6.1f}", flush=True)
    half = data[: data.numel() // 2]
    dst = torch.empty_like(half)
    print(f"  torch copy of 16.8 MB (33.6 MB moved): {timed_cold(events, flush, lambda: dst.copy_(half)):6.1f}")
    w = data.view(torch.bfloat16).view(4096, 4096)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    y = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)

    def bf16_gemv():
        gemv_mod.gemv(x, w, y, config=gemv_mod.LM_HEAD_CONFIG)

    bf16_gemv()
    print(f"  bf16 gemv [4096, 4096] (33.6 MB, the head's tiles): {timed_cold(events, flush, bf16_gemv):6.1f} / "
          f"{timed_cold(events, flush, bf16_gemv, ahead):6.1f}", flush=True)


def _weight_parts(x) -> list[torch.Tensor]:
    from draftgraph.runtime.model.quant import QuantWeight

    if isinstance(x, QuantWeight):
        return [x.data, x.scale]
    return [x] if isinstance(x, torch.Tensor) and x.is_cuda else []


def install(plan_name: str, mode: str = "bulk") -> None:
    """Make every eager run (and so every capture) fork the plan's prefetches on a side stream."""
    from draftgraph.runtime.execution import eager

    plan, streams = PLANS[plan_name], {}  # device -> the probe's side stream

    def targets(executor) -> dict[str, list[tuple[torch.Tensor, int]]]:
        found = executor.__dict__.get("_probe_targets")
        if found is not None:
            return found
        steps = {s.node.name: s for _, seg in executor.segments for s in seg}
        found = {}
        for at, (target, mb) in plan.items():
            if at not in steps or target not in steps:
                continue
            budget, parts = mb << 20, []
            for name, x in zip(steps[target].node.inputs, steps[target].inputs):
                if not name.startswith(("mtp.", "head.")) or "kv_cache" in name:
                    continue
                for t in _weight_parts(x):
                    if t.dim() == 3 and t.nbytes > (256 << 20):
                        continue  # stacked routed experts
                    take = min(t.nbytes, budget)
                    if take >= 4096 and budget > 0:
                        parts.append((t, take))
                        budget -= take
            found[at] = parts
            print(f"  plan: at {at} -> {target}: "
                  + ", ".join(f"{list(t.shape)} {n / 2**20:.1f} MB" for t, n in parts), flush=True)
        executor._probe_targets = found
        return found

    run_steps, run_step = eager.EagerExecutor._run_steps, eager.EagerExecutor._run_step

    def forking_step(self, step, inputs, side=None):
        """The step, after forking its prefetches onto the probe's stream (no fork where the executor
        runs without side lanes: the CPU, a gated region)."""
        parts = targets(self).get(step.node.name) if side is not None else None
        if parts:
            lane = streams.setdefault(self.device, torch.cuda.Stream(self.device))
            lane.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(lane):
                for t, n in parts:
                    prefetch(t, n, mode=mode)
            self._probe_forked = True
        return run_step(self, step, inputs, side)

    def joining_steps(self, steps, inputs, overlap=True):
        try:
            return run_steps(self, steps, inputs, overlap)
        finally:
            if self.__dict__.pop("_probe_forked", False):  # a capture must rejoin its forks
                torch.cuda.current_stream(self.device).wait_stream(streams[self.device])

    eager.EagerExecutor._run_step, eager.EagerExecutor._run_steps = forking_step, joining_steps


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "micro":
        return micro()
    if what == "tiles":
        return tiles()
    if what == "floor":
        return floor()
    if what != "chain" or "--" not in sys.argv:
        raise SystemExit(__doc__.split("\n\n")[1])
    sep = sys.argv.index("--")
    choice, rest = sys.argv[2:sep], sys.argv[sep + 1:]
    if choice and choice[0] != "off":
        install(choice[0], choice[1] if len(choice) > 1 else "bulk")
    print("prefetch plan:", " ".join(choice) or "off", flush=True)
    run_bench_draft(rest)


if __name__ == "__main__":
    main()
