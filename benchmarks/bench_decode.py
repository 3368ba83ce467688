"""Steady-state decode speed: speculative (MTP drafts) against plain greedy, eager against captured.

    python benchmarks/bench_decode.py [--device cuda|cpu] [--batches 1,16] [--max-tokens 128] [-k 3]
                                      [--executors eager,captured] [--checkpoint DIR] [--threads N]

For each batch B (B prompts decoded together) and executor, in one process and on the same
target (the checkpoint's, tools/data/tiny_v4 by default, else a random small model):

- ``greedy``: plain greedy decoding with the target alone (one forward a token);
- ``spec``: speculative decoding, K drafts a round, the device loop (decode/loop.py);
- ``spec host``: the same with the host path (drafts and verify read back each step).

Every run (``--repeat``: the fastest of that many) warms up first (every executor built, on CUDA
captured and its kernels compiled) and that time is reported apart (``warm-up s``); tokens/s are
steady state: generated tokens over the prefill and the steps. No EOS: every sequence makes
``--max-tokens`` tokens. The time split (ms a step: propose, verify, catch-up, host; the device
loop writes the catch-up rows in the next propose's first step, so its propose holds them) comes from
a second speculative run that waits for the device at each phase's end (``sync_phases``; on the
CPU the same run). Ratios: ``spec/greedy`` (what speculation gives), and per B
``captured/eager``. Captured rows need CUDA: without it they say so. ``same`` says whether the
speculative tokens equal greedy's (they must where the target's numerics do not depend on a
run's row count; see loop.py).

The target has row buckets 1, 2, 4 .. up to what B x (K + 1) verify rows need, so greedy runs
B rows (not a verify window's bucket); the proposer's go up to B x (K + 2) rows, a merged first
step's most (before 2026-12-05 it had its default buckets, up to 64 rows: at B=16 and K=3 a step
accepting more than 2 drafts a sequence on average spilled its catch-up rows into a prefill run).

``--builds`` answers issue 27's profile question instead: the ``draftgraph decode`` workload
(its models and buckets, ``--prompt`` repeatable) decoded with warm-up off (the loop as it was:
every executor made on first use) and on, printing at which step each executor is built
(target row bucket, K-draft chain batch bucket, drafter-prefill row bucket) and what
``build_counts`` saw (executor builds, CUDA graph captures, Triton compiles) in the steps.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\n",
    "def main(",
    "for i in range(10):\n    print(i",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import sys\nimport json\n\n\ndef load(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "def read_lines(path):\n    with open(path) as f:\n",
]


def row_buckets(batch: int, num_drafts: int) -> tuple[int, ...]:
    top = max(16, batch * (num_drafts + 1))
    top = 1 << (top - 1).bit_length()
    return tuple(1 << i for i in range(top.bit_length()))


def load(checkpoint: Path | None, device: str, executor: str, batch: int, num_drafts: int):
    from draftgraph.runtime.decode.target import TargetModel
    from draftgraph.runtime.model.weights import MTP_TENSOR_NAMES, TARGET_TENSOR_NAMES, load_checkpoint
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from draftgraph.tools.workload import resolve_checkpoint

    path, note = resolve_checkpoint(checkpoint)
    ckpt = load_checkpoint(path, names="all", device="cpu")
    config = ckpt.config
    target = TargetModel(config, {e.name: ckpt.tensors[e.name] for e in TARGET_TENSOR_NAMES(config)},
                         device=device, executor=executor, buckets=row_buckets(batch, num_drafts),
                         max_sequences=max(8, batch))
    # The device loop's merged first step runs B propose rows and up to B (K + 1) catch-up rows: buckets up
    # to B (K + 2), so that no step spills rows into a drafter-prefill run of their own (a graph run more).
    proposer = DeepseekV4MtpProposer(config, {e.name: ckpt.tensors[e.name] for e in MTP_TENSOR_NAMES(config)},
                                     device=device, executor=executor, buckets=row_buckets(batch, num_drafts + 1))
    return target, proposer, note


class Clock:
    """Timestamps of the launches and the read-backs, in the order they happen."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def mark(self, what: str) -> None:
        self.events.append((what, time.perf_counter()))

    def gaps(self, read: str) -> list[float]:
        """Seconds from each ``read`` to the next launch after it."""
        out, since = [], None
        for what, at in self.events:
            if what == read:
                since = at
            elif what == "launch" and since is not None:
                out.append(at - since)
                since = None
        return out


@contextlib.contextmanager
def wrapped_runs(executors, wrap):
    """Each executor's ``run`` replaced by ``wrap(run, executor)`` for the block; after it, the class's
    again, or the run the instance had set (a stub) back."""
    executors = list(executors)
    own = [vars(executor).get("run") for executor in executors]
    for executor in executors:
        executor.run = wrap(executor.run, executor)
    try:
        yield
    finally:
        for executor, run in zip(executors, own):
            if run is None:
                del executor.run
            else:
                executor.run = run


@contextlib.contextmanager
def marking(target, proposer, num_drafts: int, clock: Clock):
    """Mark each verdict read-back ("read") and each launch of a proposer graph built so far ("launch")."""
    verifier = target.device_verifier(num_drafts)
    read_verdict = verifier.read_verdict

    def read_and_mark(n):
        out = read_verdict(n)
        clock.mark("read")
        return out

    def launching(run, executor):
        def marked(inputs, check=True):
            clock.mark("launch")
            return run(inputs, check)

        return marked

    verifier.read_verdict = read_and_mark
    try:
        with wrapped_runs(proposer._executors.values(), launching):
            yield clock
    finally:
        verifier.read_verdict = read_verdict


def best(runs):
    """The run of the highest tokens/s (the least disturbed by other work on the machine)."""
    return max(runs, key=lambda result: result.stats.tokens_per_second)


def measure(target, proposer, prompts, max_tokens: int, num_drafts: int, repeat: int = 1) -> dict:
    from draftgraph.runtime.decode.loop import greedy_decode, speculative_decode

    greedy = best([greedy_decode(target, prompts, max_tokens) for _ in range(repeat)])
    rows = {"greedy": greedy.stats}
    tokens = {}
    for name, device_loop in (("spec", True), ("spec host", False)):
        result = best([speculative_decode(target, proposer, prompts, max_tokens, num_drafts, device_loop=device_loop)
                       for _ in range(repeat)])
        rows[name] = result.stats
        tokens[name] = result.tokens
        if device_loop:  # the host gap a step: from the verdict on the host to the next propose's launch
            with marking(target, proposer, num_drafts, Clock()) as clock:
                speculative_decode(target, proposer, prompts, max_tokens, num_drafts, device_loop=True)
            gaps = clock.gaps("read")
            rows[name + " gap"] = statistics.median(gaps) if gaps else float("nan")
        if target.device.type == "cuda":  # the split from a run that waits at each phase's end
            synced = speculative_decode(target, proposer, prompts, max_tokens, num_drafts, device_loop=device_loop,
                                        sync_phases=True)
            rows[name + " split"] = synced.stats
    return {"stats": rows, "same": {name: toks == greedy.tokens for name, toks in tokens.items()}}


def format_rows(results: dict, batches, executors) -> list[str]:
    head = (f"{'B':>3} {'executor':<9} {'run':<10} {'tok/s':>9} {'spec/greedy':>11} {'acc len':>7} "
            f"{'propose':>8} {'verify':>8} {'catch-up':>8} {'host':>7} {'reads':>5} {'warm-up s':>9} {'same':>5} "
            f"{'gap us':>7} {'full tok/s':>10} {'full s/g':>8}")
    lines = [head, "-" * len(head)]
    for b in batches:
        for ex in executors:
            entry = results.get((b, ex))
            if entry is None:
                lines.append(f"{b:>3} {ex:<9} {'-':<10} needs CUDA")
                continue
            stats = entry["stats"]
            greedy = stats["greedy"].tokens_per_second
            for name in ("greedy", "spec", "spec host"):
                s = stats[name]
                split = stats.get(name + " split", s)
                steps = max(split.num_steps, 1)
                ratio = f"{s.tokens_per_second / greedy:.2f}" if name != "greedy" and greedy else ""
                phases = [1e3 * split.propose_seconds / steps, 1e3 * split.verify_seconds / steps,
                          1e3 * split.catchup_seconds / steps, 1e3 * split.host_seconds / steps]
                acc = f"{s.mean_accepted_length:.2f}" if name != "greedy" else "1.00"
                reads = f"{s.num_read_backs / max(s.num_steps, 1):.1f}" if name != "greedy" else ""
                same = {True: "yes", False: "no"}.get(entry["same"].get(name), "")
                gap = f"{1e6 * stats[name + ' gap']:.1f}" if name + " gap" in stats else ""
                full = s.full_batch_tokens_per_second
                full_ratio = (f"{full / stats['greedy'].full_batch_tokens_per_second:.2f}"
                              if name != "greedy" and stats["greedy"].full_batch_tokens_per_second else "")
                lines.append(f"{b:>3} {ex:<9} {name:<10} {s.tokens_per_second:>9.1f} {ratio:>11} {acc:>7} "
                             + "".join(f"{p:>8.2f} " for p in phases[:3]) + f"{phases[3]:>7.2f} {reads:>5} "
                             f"{s.warmup_seconds:>9.2f} {same:>5} {gap:>7} {full:>10.1f} {full_ratio:>8}")
    lines.append("")
    lines.append("captured / eager, tokens/s:")
    for b in batches:
        eager, captured = results.get((b, "eager")), results.get((b, "captured"))
        if eager is None or captured is None:
            lines.append(f"  B={b}: needs both (captured needs CUDA)")
            continue
        parts = [f"{name} {captured['stats'][name].tokens_per_second / eager['stats'][name].tokens_per_second:.2f}x"
                 for name in ("greedy", "spec", "spec host")]
        lines.append(f"  B={b}: " + ", ".join(parts))
    return lines


def profile_builds(args) -> list[str]:
    """Per step: the executors built (lazily, warm-up off) and the build counts with warm-up on."""
    from draftgraph.runtime.decode.loop import DecodeSession
    from draftgraph.runtime.decode.target import TargetModel
    from draftgraph.runtime.decode.warmup import build_counts
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from draftgraph.tools.workload import add_workload_args, load_workload

    built: list[tuple[int, str]] = []
    step = [0]

    def watch(cls, name, describe):
        method = getattr(cls, name)

        def wrapper(self, *a):
            fresh = len(self._executors)
            out = method(self, *a)
            if len(self._executors) > fresh:
                built.append((step[0], describe(*a)))
            return out

        setattr(cls, name, wrapper)
        return method

    saved = [(DeepseekV4MtpProposer, "_executor", watch(DeepseekV4MtpProposer, "_executor",
                                                          lambda b, k, m: f"chain B={b} K={k}")),
             (DeepseekV4MtpProposer, "_prefill_executor", watch(DeepseekV4MtpProposer, "_prefill_executor",
                                                                  lambda b: f"drafter prefill R={b}")),
             (TargetModel, "_executor", watch(TargetModel, "_executor", lambda b: f"target R={b}"))]
    parser = argparse.ArgumentParser()
    add_workload_args(parser, args.max_tokens)
    argv = [a for p in (args.prompt or ["import os", "def main("]) for a in ("--prompt", p)]
    argv += ["--max-tokens", str(args.max_tokens), "-k", str(args.num_drafts), "--device", args.device]
    lines = []
    try:
        for warmup in (False, True):
            work = load_workload(parser.parse_args(argv))
            built.clear()
            step[0] = 0
            session = DecodeSession(work.target, work.proposer, work.encoded, work.max_tokens, work.num_drafts,
                                    eos_id=work.tokenizer.eos_id, warmup=warmup)
            if warmup:
                session.warm_up()
            before, lives = build_counts(), []
            step[0] = 1
            while True:
                lives.append(len(session.live))
                if not session.step():
                    break
                step[0] += 1
            steps = build_counts() - before
            stats = session.stats
            lines.append(f"# warm-up {'on' if warmup else 'off'}: {step[0]} steps (step 1 = the prefill), live "
                         f"sequences per step {lives[:3]} .. {lives[-3:]}, propose {stats.propose_seconds:.3f} s, "
                         f"catch-up {stats.catchup_seconds:.3f} s, warm-up {stats.warmup_seconds:.3f} s")
            for at, what in built:
                lines.append(f"  {'warm-up' if at == 0 else f'step {at}':>8}  built {what}")
            lines.append(f"  in the steps: {steps.executors} executors built, {steps.captures} CUDA graphs captured, "
                         f"{steps.kernel_compiles} Triton compiles, {steps.torch_compiles} torch.compile graphs")
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-drafts", type=int, default=3)
    ap.add_argument("--executors", default="eager,captured")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU runs: 1 is steadier)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each decode; the fastest is reported")
    ap.add_argument("--builds", action="store_true", help="where executors are built, per step (issue 27)")
    ap.add_argument("--prompt", action="append", default=None, help="--builds: a prompt (repeatable)")
    args = ap.parse_args(argv)
    from draftgraph.runtime.decode.tokenizer import ByteTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.builds:
        print("\n".join(profile_builds(args)))
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    executors = args.executors.split(",")
    tok = ByteTokenizer()
    results, note = {}, ""
    started = time.perf_counter()
    for b in batches:
        prompts = [tok.encode(PROMPTS[i % len(PROMPTS)], add_bos=True) for i in range(b)]
        for ex in executors:
            if ex == "captured" and not args.device.startswith("cuda"):
                continue
            target, proposer, note = load(args.checkpoint, args.device, ex, b, args.num_drafts)
            results[(b, ex)] = measure(target, proposer, prompts, args.max_tokens, args.num_drafts, args.repeat)
            del target, proposer
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# bench_decode: {device}, checkpoint {note}, K={args.num_drafts}, {args.max_tokens} tokens a sequence, "
          f"threads {torch.get_num_threads()}")
    print("# ms a step: propose, verify, catch-up, host (the rest); reads: device-to-host reads a step; "
          "spec (the device loop): the catch-up rides in the propose's first step; gap: the median host "
          "time from the verdict read back to the next propose's first launch (a run of its own); full: the rounds "
          "that began with all B sequences live (a lockstep batch ends in rounds with fewer; an engine that refills "
          "its batch runs none), tokens/s and spec/greedy")
    print("\n".join(format_rows(results, batches, executors)))
    print(f"# {time.perf_counter() - started:.1f} s in all; argv: {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
