"""The decode loop's own host work a step, with every graph run stubbed (the CPU harness).

    python benchmarks/bench_loop_host.py [--batches 1,16] [--steps 300] [--repeat 5] [-k 3]
                                         [--accept 3,1,2,3] [--checkpoint DIR]

On a GPU a decode step of the device loop (decode/loop.py, ``spec``) is: the host reads the
verdict back (the step's one sync), commits it, and stages and launches the next step's graphs.
From the read-back to the first launch the GPU has nothing to run: that host time is added to
every step, whatever the graphs cost. Greedy decoding has the same gap a token (read the token,
stage, launch). A GPU run cannot show these gaps apart from the device's own time, so this
harness takes the graphs out: the proposer's and the target's executors are replaced by
functions that return the outputs of one real run (as bench_host.py does for the proposer),
and the verify writes a fixed verdict (``--accept``: the accepted counts, cycled, every draft
position's token the same). What is left is the loop's host work, timed per step:

- ``gap``: from the verdict on the host to the next step's first graph launch (spec), or from
  one token on the host to the next forward's launch (greedy): the GPU's idle time a step;
- ``host``: all of the step's host work (on a GPU, the rest overlaps the graphs' run).

Medians over ``--steps`` steps of the best of ``--repeat`` decodes, in microseconds. The
tiny model (tools/data/tiny_v4) and the buckets are bench_decode.py's. The eager executors run
once per bucket (their first call) and never again, so the CPU's torch ops cost nothing here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import bench_decode as bench  # its model loading, buckets and prompts, and the clock
import numpy as np
import torch
from bench_decode import Clock


def stub_runs(executors: dict, clock: Clock, after=None) -> None:
    """Each executor returns its first real outputs from then on; every call marks a launch."""
    for executor in executors.values():
        real = vars(executor).get("_real_run") or type(executor).run
        outputs: dict = {}

        def run(inputs, check=True, executor=executor, outputs=outputs, real=real):
            clock.mark("launch")
            if not outputs:
                outputs.update(real(executor, inputs, check))
            if after is not None:
                after()
            return outputs

        executor._real_run, executor.run = real, run


def fixed_verdict(verifier, accept: list[int]):
    """The verify's stand-in: the verdict of every live row says ``accept[step % len]`` drafts."""
    from draftgraph.ops.acceptance import ACCEPTED, DROPPED, NONFINITE_HIDDEN, TOKENS

    step = [0]

    def write() -> None:
        verdict = verifier.verdict
        verdict[:, ACCEPTED] = accept[step[0] % len(accept)]
        verdict[:, DROPPED] = 0
        verdict[:, NONFINITE_HIDDEN] = 0
        verdict[:, TOKENS:] = 65  # "A": a byte token every tokenizer of the tiny model has
        step[0] += 1

    return write


def measure(target, proposer, prompts, steps: int, k: int, accept: list[int], repeat: int) -> dict:
    from draftgraph.runtime.decode.loop import greedy_decode, speculative_decode

    clock = Clock()
    verifier = target.device_verifier(k)
    speculative_decode(target, proposer, prompts, 16, k)  # builds every executor the runs below use
    greedy_decode(target, prompts, 16)
    stub_runs(proposer._executors, clock)
    stub_runs(target._executors, clock)
    stub_runs(verifier._executors, clock, after=fixed_verdict(verifier, accept))
    read_verdict = verifier.read_verdict

    def read_and_mark(n):
        out = read_verdict(n)
        clock.mark("read")
        return out

    verifier.read_verdict = read_and_mark
    rows = {}
    tokens = steps * (1 + statistics.mean(accept))
    for name, decode in (("spec", lambda: speculative_decode(target, proposer, prompts, int(tokens), k)),
                         ("greedy", lambda: greedy_decode(target, prompts, steps))):
        best = None
        for _ in range(repeat):
            clock.events.clear()
            result = decode()
            stats = result.stats
            host = (stats.total_seconds - stats.prefill_seconds) / max(stats.num_steps, 1)
            if name == "greedy":  # a token read back is the forward's own read: the gap is launch to launch
                launches = [at for what, at in clock.events if what == "launch"]
                gaps = np.diff(launches[1:]).tolist()  # the prefill's launch first
            else:
                gaps = clock.gaps("read")
            entry = (statistics.median(gaps) if gaps else float("nan"), host, stats.num_steps)
            best = entry if best is None or entry[0] < best[0] else best
        rows[name] = best
    verifier.read_verdict = read_verdict
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=300, help="decode steps a run (greedy: tokens)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("-k", "--num-drafts", type=int, default=3)
    ap.add_argument("--accept", default="3,1,2,3", help="accepted drafts a step, cycled")
    ap.add_argument("--checkpoint", type=Path, default=None)
    args = ap.parse_args(argv)
    accept = [int(a) for a in args.accept.split(",")]
    if any(not 0 <= a <= args.num_drafts for a in accept):
        ap.error(f"--accept: counts in 0..{args.num_drafts} (K), got {args.accept}")
    from draftgraph.runtime.decode.tokenizer import ByteTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the real runs (one per bucket) on the tiny model: one thread is faster
    tok = ByteTokenizer()
    print(f"# bench_loop_host: cpu, graph runs stubbed, K={args.num_drafts}, accepted {accept} cycled, "
          f"{args.steps} steps, best of {args.repeat}; us a step (greedy: a token)")
    print(f"{'B':>3} {'loop':<7} {'gap us':>8} {'host us':>8} {'steps':>6}")
    try:
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = [tok.encode(bench.PROMPTS[i % len(bench.PROMPTS)], add_bos=True) for i in range(b)]
            target, proposer, _ = bench.load(args.checkpoint, "cpu", "eager", b, args.num_drafts)
            for name, (gap, host, steps) in measure(target, proposer, prompts, args.steps, args.num_drafts, accept,
                                                    args.repeat).items():
                print(f"{b:>3} {name:<7} {1e6 * gap:>8.1f} {1e6 * host:>8.1f} {steps:>6}")
    finally:
        torch.set_num_threads(threads)
    print(f"# argv: {' '.join(sys.argv[1:] if argv is None else argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
