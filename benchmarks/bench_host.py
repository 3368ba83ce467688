"""Host time per propose: everything the CPU does from entering ``_propose`` to the graph launch, and after.

    python benchmarks/bench_host.py [--device cpu|cuda] [--iters N] [--positions 200,3000] [--cases 1x1,1x3,32x1,32x3]
                               [--copies raw,torch] [--hiddens list|tensor] [--rows staggered|lockstep]

Builds a small-config proposer (``V4Config.small()``, random MTP weights) and, for each
case B x K and start position, runs a decode-like loop: propose, accept every draft
(``after_verify``), move the position on by K. ``--rows staggered`` (the default) starts row i
at ``position + i * block_size // B``, so that rows cross into a new block (an ensure, a
staged table) and leave one behind the window (a trim that gives it back) on different
steps, as a serving batch's rows do; ``--rows lockstep`` starts them all at ``position``
(the files before 2026-12-04): then all B rows cross on the same step, once every
``block_size / K`` steps, and the median step is one where none does. It prints per case

- ``host``: the median of ``last_host_seconds``, entering ``_propose`` up to the (async)
  launch; ``mean`` and ``p90``, its mean and 90th percentile (the steps where rows cross);
- ``call``: the median of the whole ``propose`` / ``propose_batch`` call, launch and
  read-back included, and the median of
- the phases of one propose, from a second, instrumented pass (wrappers add ~0.3 us each):
  ``checks`` (entering ``_propose`` up to the stage: the batch's arrays, the hiddens' checks,
  the launch plan's lookup, and the batch kernel's checks and the blocks it maps for the rows
  crossing into a block), ``stage`` (``ChainStaging.stage``: the metadata, tokens and hiddens'
  addresses; the staging copy where the graph does not copy it itself), ``run`` (the
  executor's ``run``: the replay's launch on CUDA), ``wait`` (``read_rows``: waiting for the
  replay, the device-to-host copy of the drafts and its sync) and ``commit`` (the batch kernel
  writing the rows back and giving back the blocks behind the windows, to the return).

The harness that isolates host work (``--device cpu``): the chain executor's ``run`` is
replaced by a function that returns the outputs of one real run, so no graph executes and
what is timed is the proposer's own host work (on CPU an eager run would take milliseconds
and hide it). ``--device cuda`` times a real captured proposer: ``run`` is the replay launch.
``--copies raw,torch`` times each case twice: the staging copies and the graph launch through
cuda-python (:mod:`draftgraph.runtime.execution.raw_copy`,
:mod:`draftgraph.runtime.execution.launch`, the default), and through
``Tensor.copy_`` and ``CUDAGraph.replay()``. ``--hiddens tensor`` hands ``propose_batch`` the
hiddens as one [B, C, D] tensor (as vLLM and SGLang hold them) instead of a list of B (B=1
proposes one row either way).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch
from draftgraph.runtime.execution import launch as raw_launch
from draftgraph.runtime.execution import raw_copy
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

PHASES = ("checks", "stage", "run", "wait", "commit")
WARMUP_ROUNDS = 100


def make_proposer(device: str) -> DeepseekV4MtpProposer:
    cfg = V4Config.small()
    executor = "captured" if device == "cuda" else "eager"
    return DeepseekV4MtpProposer(cfg, random_mtp_weights(cfg, seed=0), device=device, executor=executor)


class DecodeLoop:
    """B sequences proposing K drafts each round, every draft accepted, positions moving on."""

    def __init__(self, prop: DeepseekV4MtpProposer, batch: int, num_drafts: int, position: int,
                 hiddens: str = "list", rows: str = "staggered"):
        self.prop, self.batch, self.k = prop, batch, num_drafts
        cfg, device = prop.config, prop.device
        gen = torch.Generator().manual_seed(batch)
        rows_hidden = [torch.randn(cfg.hc_mult, cfg.hidden_size, generator=gen).bfloat16().to(device)
                       for _ in range(batch)]
        self.hidden0 = rows_hidden[0]  # what a B=1 propose takes, in either form
        self.hiddens = torch.stack(rows_hidden) if hiddens == "tensor" else rows_hidden  # stacked once, not per step
        self.tokens = [(7 * i + 1) % cfg.vocab_size for i in range(batch)]
        self.states = [prop.alloc_state() for _ in range(batch)]
        bs = prop.cache.block_size
        if rows not in ("staggered", "lockstep"):
            raise ValueError(f"rows: expected 'staggered' or 'lockstep', got {rows!r}")
        self.starts = [position + (i * bs // batch if rows == "staggered" else 0) for i in range(batch)]
        self.positions = list(self.starts)

    def step(self) -> None:
        prop = self.prop
        if max(self.positions) + self.k >= prop.max_seq_len:  # wrap round: fresh states
            for state in self.states:
                prop.free_state(state)
            self.states = [prop.alloc_state() for _ in range(self.batch)]
            self.positions = list(self.starts)
        if self.batch == 1:
            prop.propose(self.tokens[0], self.hidden0, self.positions[0], self.k, self.states[0])
        else:
            prop.propose_batch(self.tokens, self.hiddens, self.positions, self.k, self.states)
        prop.after_verify_batch([self.k] * self.batch, self.states)
        self.positions = [p + self.k for p in self.positions]


def stub_chain_runs(prop: DeepseekV4MtpProposer) -> None:
    """The CPU harness: every chain executor returns its first real outputs instead of running."""
    for key, executor in prop._executors.items():
        if key[0] != "chain" or "run" in vars(executor):
            continue
        outputs = {}

        def run(inputs, check=True, executor=executor, outputs=outputs):
            if not outputs:
                outputs.update(type(executor).run(executor, inputs, check))
            return outputs

        executor.run = run


class LoopTimes(NamedTuple):
    """Microseconds of one case: host (median, mean, 90th percentile) and call (median)."""

    host: float
    host_mean: float
    host_p90: float
    call: float


def time_loop(loop: DecodeLoop, iters: int, stub: bool) -> LoopTimes:
    """Host and call microseconds of ``iters`` rounds (after a warm-up).

    The warm-up is long, so that the first cases of a run are not timed colder than the rest
    (with 5 rounds, the B=1 rows of the first start position in the run at ef07d1a came out
    up to 1.5x slower than those of the second). That was not all of it: with 100 rounds and
    the positions in the other order (``benchmarks/h200/bench_host_1d36a1e.txt``), one B=1
    K=3 row still took 1.7x the other, every phase alike: the H200 hosts' CPUs are noisy.
    """
    for _ in range(WARMUP_ROUNDS):
        loop.step()
        if stub:
            stub_chain_runs(loop.prop)
    host, call = [], []
    for _ in range(iters):
        start = time.perf_counter()
        loop.step()
        call.append(time.perf_counter() - start)
        host.append(loop.prop.last_host_seconds)
    host.sort()
    return LoopTimes(statistics.median(host) * 1e6, statistics.mean(host) * 1e6, host[int(0.9 * (len(host) - 1))] * 1e6,
                     statistics.median(call) * 1e6)


class PhaseClock:
    """Wraps the proposer's steps with timestamps; ``phases()`` splits one propose."""

    def __init__(self, prop: DeepseekV4MtpProposer):
        self.marks: list[tuple[str, float]] = []
        self._wrapped: list[tuple[object, str, object]] = []  # (object, attribute, its own value or None)
        self._wrap(prop, "_propose", "propose")
        for staging in prop._staging.values():
            self._wrap(staging, "stage", "stage")
            self._wrap(staging, "read_rows", "read")
        for key, executor in prop._executors.items():
            if key[0] == "chain":
                self._wrap(executor, "run", "run")

    def _wrap(self, obj, attr: str, label: str) -> None:
        if not hasattr(obj, attr):  # an older runtime (a baseline run) may lack it
            return
        inner, marks = getattr(obj, attr), self.marks
        self._wrapped.append((obj, attr, vars(obj).get(attr)))

        def timed(*args, **kw):
            marks.append((label + "<", time.perf_counter()))
            try:
                return inner(*args, **kw)
            finally:
                marks.append((label + ">", time.perf_counter()))

        setattr(obj, attr, timed)

    def remove(self) -> None:
        """Put back what was there before (the CPU stub stays)."""
        for obj, attr, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)

    def phases(self) -> dict[str, float]:
        """One propose's marks as phase durations (the first read only: the drafts')."""
        at: dict[str, float] = {}
        for label, t in self.marks:
            at.setdefault(label, t)
        self.marks.clear()
        return {
            "checks": at["stage<"] - at["propose<"],
            "stage": at["stage>"] - at["stage<"],
            "run": at["run>"] - at["stage>"],
            "wait": at["read>"] - at["run>"],
            "commit": at["propose>"] - at["read>"],
        }


def time_phases(prop: DeepseekV4MtpProposer, step, iters: int) -> dict[str, float]:
    """Median microseconds of each phase of ``iters`` calls of ``step`` (proposes on ``prop``)."""
    clock = PhaseClock(prop)
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    try:
        for _ in range(iters):
            step()
            for name, seconds in clock.phases().items():
                samples[name].append(seconds)
    finally:
        clock.remove()
    return {p: statistics.median(s) * 1e6 for p, s in samples.items()}


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in case.split("x")) for case in text.split(",")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--positions", default="200,3000", help="start positions, comma separated")
    parser.add_argument("--cases", default="1x1,1x3,32x1,32x3", help="BxK, comma separated")
    parser.add_argument("--copies", default="raw",
                        help="staging copies and graph launch: raw (cuda-python), torch, or both: raw,torch")
    parser.add_argument("--rows", choices=("staggered", "lockstep"), default="staggered",
                        help="rows' start positions spread over a block (serving), or all at the same one")
    parser.add_argument("--hiddens", choices=("list", "tensor"), default="list",
                        help="propose_batch's hiddens: a list of B [C, D] tensors, or one [B, C, D] tensor")
    args = parser.parse_args(argv)
    copies = args.copies.split(",")
    if not set(copies) <= {"raw", "torch"}:
        parser.error(f"--copies: expected raw and/or torch, got {args.copies!r}")
    raw_available, launch_available = raw_copy.is_enabled, raw_launch.is_enabled
    torch.set_num_threads(1)  # host work is single-threaded; no pool wake-ups in the numbers
    prop = make_proposer(args.device)
    stub = args.device == "cpu"
    print(f"host path per propose, median us over {args.iters} rounds, device {args.device}"
          f"{' (executor run stubbed: host work only)' if stub else ' (captured replay)'}"
          f", hiddens as {'one [B, C, D] tensor' if args.hiddens == 'tensor' else 'a list of B [C, D] tensors'}"
          f", rows {args.rows}")
    if "raw" in copies and not raw_available:
        print("  (no cuda-python or no CUDA build of torch: the raw rows use torch copies)")
    print(f"{'B':>3} {'K':>2} {'pos':>5} {'copies':>6} {'host':>7} {'mean':>7} {'p90':>7} {'call':>7}  "
          + " ".join(f"{p:>7}" for p in PHASES))
    try:
        for position in (int(p) for p in args.positions.split(",")):
            for batch, k in parse_cases(args.cases):
                for mode in copies:
                    raw_copy.is_enabled = raw_available and mode == "raw"
                    raw_launch.is_enabled = launch_available and mode == "raw"
                    loop = DecodeLoop(prop, batch, k, position, args.hiddens, args.rows)
                    t = time_loop(loop, args.iters, stub)
                    phases = time_phases(loop.prop, loop.step, args.iters)
                    print(f"{batch:>3} {k:>2} {position:>5} {mode:>6} {t.host:7.1f} {t.host_mean:7.1f} "
                          f"{t.host_p90:7.1f} {t.call:7.1f}  "
                          + " ".join(f"{phases[p]:7.1f}" for p in PHASES), flush=True)
                    for state in loop.states:
                        prop.free_state(state)
    finally:
        raw_copy.is_enabled, raw_launch.is_enabled = raw_available, launch_available


if __name__ == "__main__":
    main()
