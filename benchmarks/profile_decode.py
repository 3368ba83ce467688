"""Where a decode step's time goes on the GPU: the device busy, the device idle, each graph's span (GPU).

    python benchmarks/profile_decode.py [--batches 1,16] [--max-tokens 128] [-k 3] [--checkpoint DIR] [--events]

bench_decode.py times phases from the host; this profiles whole steady-state decodes (the tiny
model, captured, after a run that built every executor; the profiled runs build nothing and warm
nothing up) with the torch profiler's CUDA activity and reads the device's own timeline:

- ``busy``: the union of the kernels' and copies' intervals, a step (a token for greedy): what the
  GPU does; ``idle``: the rest of the decode's wall time a step, where the GPU waits on the host
  (staging, launches, read-backs, bookkeeping). The prefill is in both;
- ``host gap``: the median time from the end of a wait on the device (a synchronize, or a copy
  call that blocked) to the next graph launch: the host's work while nothing is queued;
- per CUDA graph launched (told apart by its kernel count): launches a step, the median span on
  the device (first kernel's start to last kernel's end) and the median of its kernels' own time
  (span minus that: the gaps between the graph's nodes);
- ``outside``: device operations a step that no graph launched (eager copies and kernels);
- ``waits``: the host's waits on the device a step, by runtime call (every synchronize, and the
  copies that blocked), with the median time each: a step of the device loop should wait once
  (its verdict's read-back), a greedy token once (its token's).

``--events``: no profiler (whose per-call cost slows the host it measures); a CUDA event before
and after every graph launch instead, and per graph: launches a step, the median time the GPU sat
idle before it (its 'before' event minus the previous graph's 'after': host work it waited for,
with any eager device work between them) and the median span between its two events.

Needs CUDA. The decode is bench_decode.py's (its prompts, buckets and loader). The arithmetic on
the timeline (:func:`summarise`, :func:`idle_before`) takes plain records and is tested on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import bench_decode as bench
import torch

GRAPH_LAUNCH = "cudaGraphLaunch"
BLOCKED_NS = 5_000  # a runtime call this long waited on the device (an async call returns in a few us)


class Record(NamedTuple):
    """One profiler event: on the device or not, its name, correlation id, start and end (ns)."""

    on_device: bool
    name: str
    correlation: int
    start: int
    end: int


def union_ns(intervals) -> int:
    """Total length of the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def summarise(records: list[Record]) -> dict:
    """busy ns, host gaps (ns), device ops outside graphs, per kernel count [(span, kernels ns)] per launch,
    and per waiting runtime call its durations (ns)."""
    device = [r for r in records if r.on_device]
    host = sorted((r for r in records if not r.on_device), key=lambda r: r.start)
    launches = {r.correlation for r in host if r.name == GRAPH_LAUNCH}
    by_launch: dict[int, list[Record]] = defaultdict(list)
    for r in device:
        if r.correlation in launches:
            by_launch[r.correlation].append(r)
    graphs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for kernels in by_launch.values():
        span = max(r.end for r in kernels) - min(r.start for r in kernels)
        graphs[len(kernels)].append((span, union_ns((r.start, r.end) for r in kernels)))
    gaps, waited, waits = [], None, defaultdict(list)
    for r in host:
        syncs, blocked = "Synchronize" in r.name, r.end - r.start > BLOCKED_NS
        if syncs or ("Memcpy" in r.name and blocked):
            waits[r.name].append(r.end - r.start)
        if r.name == GRAPH_LAUNCH:
            if waited is not None:
                gaps.append(r.start - waited)
            waited = None
        elif blocked and (syncs or "Memcpy" in r.name):
            waited = r.end
    return {"busy_ns": union_ns((r.start, r.end) for r in device), "gaps": gaps,
            "outside": sum(1 for r in device if r.correlation not in launches), "graphs": dict(graphs),
            "waits": dict(waits)}


def timeline(decode) -> dict:
    """Profile ``decode()`` (it returns a DecodeResult): :func:`summarise` of its events, its wall ns, its result."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begun = time.perf_counter_ns()
        result = decode()
        torch.cuda.synchronize()
        wall = time.perf_counter_ns() - begun
    cuda = torch.autograd.DeviceType.CUDA
    records = [Record(e.device_type() == cuda, e.name(), e.correlation_id(), e.start_ns(), e.end_ns())
               for e in prof.profiler.kineto_results.events()]
    return {**summarise(records), "wall_ns": wall, "result": result}


def idle_before(spans: list[tuple[str, float, float]]) -> dict[str, tuple[int, float, float]]:
    """Per graph, from its launches' (name, start, end) device times in launch order: (launches, the
    median idle before it: its start minus the previous launch's end, 0 where it queued behind
    that one, and its median span). A decode's first launch has no idle before it."""
    idle: dict[str, list[float]] = defaultdict(list)
    span: dict[str, list[float]] = defaultdict(list)
    for i, (name, start, end) in enumerate(spans):
        span[name].append(end - start)
        if i:
            idle[name].append(max(start - spans[i - 1][2], 0.0))
    return {name: (len(span[name]), statistics.median(idle[name]) if idle[name] else float("nan"),
                   statistics.median(span[name])) for name in span}


def event_spans(decode, executors: dict[str, dict]) -> tuple[list[tuple[str, float, float]], object]:
    """Run ``decode()`` with a CUDA event before and after every launch of these executors (groups of
    name -> {key: executor}): the launches' (name, start us, end us) on the device, and the result."""
    marks = []
    names = {id(executor): f"{group} {key}" for group, table in executors.items() for key, executor in table.items()}

    def timing(run, executor):
        def timed(inputs, check=True):
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            out = run(inputs, check)
            after.record()
            marks.append((names[id(executor)], before, after))
            return out

        return timed

    with bench.wrapped_runs([ex for table in executors.values() for ex in table.values()], timing):
        result = decode()
        torch.cuda.synchronize()
    if not marks:
        return [], result
    zero = marks[0][1]
    return [(name, 1e3 * zero.elapsed_time(b), 1e3 * zero.elapsed_time(a)) for name, b, a in marks], result


def report_events(name: str, spans, result) -> list[str]:
    steps = max(result.stats.num_steps, 1)
    lines = [f"{name:<7} steps {steps:>4}  tokens/s {result.stats.tokens_per_second:>9.1f} (CUDA events, no profiler)"]
    for graph, (count, idle, span) in sorted(idle_before(spans).items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    {graph:<48} {count / steps:>5.2f} a step  idle before {idle:>7.1f} us  span {span:>7.1f} us")
    return lines


def report(name: str, line: dict) -> list[str]:
    steps = max(line["result"].stats.num_steps, 1)
    us = 1e-3 / steps
    gap = statistics.median(line["gaps"]) / 1e3 if line["gaps"] else float("nan")
    lines = [f"{name:<7} steps {steps:>4}  tokens/s {line['result'].stats.tokens_per_second:>9.1f}  a step:"
             f"  wall {line['wall_ns'] * us:>7.1f} us  busy {line['busy_ns'] * us:>7.1f}"
             f"  idle {(line['wall_ns'] - line['busy_ns']) * us:>7.1f}  host gap {gap:>6.1f}"
             f"  outside {line['outside'] / steps:>4.1f}"]
    if line["waits"]:
        lines.append("    waits a step: " + ", ".join(
            f"{name} {len(times) / steps:.2f} ({statistics.median(times) / 1e3:.1f} us)"
            for name, times in sorted(line["waits"].items(), key=lambda kv: -len(kv[1]))))
    for count, spans in sorted(line["graphs"].items(), key=lambda kv: -len(kv[1])):
        lines.append(f"    graph of {count:>3} kernels: {len(spans) / steps:>5.2f} a step, span "
                     f"{statistics.median(s for s, _ in spans) / 1e3:>7.1f} us, kernels "
                     f"{statistics.median(k for _, k in spans) / 1e3:>7.1f} us (median of {len(spans)})")
    return lines


def profile_batch(checkpoint, prompts, max_tokens: int, k: int, events: bool = False) -> list[str]:
    from draftgraph.runtime.decode.loop import greedy_decode, speculative_decode

    target, proposer, _ = bench.load(checkpoint, "cuda", "captured", len(prompts), k)
    runs = {"greedy": lambda warm: greedy_decode(target, prompts, max_tokens, warmup=warm),
            "spec": lambda warm: speculative_decode(target, proposer, prompts, max_tokens, k, device_loop=True,
                                                    warmup=warm)}
    for decode in runs.values():
        decode(True)  # every executor built and captured, kernels compiled
    if events:
        groups = {"proposer": proposer._executors, "target": target._executors,
                  "verify": target.device_verifier(k)._executors}
        return [line for name, decode in runs.items()
                for line in report_events(name, *event_spans(lambda decode=decode: decode(False), groups))]
    return [line for name, decode in runs.items()
            for line in report(name, timeline(lambda decode=decode: decode(False)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-drafts", type=int, default=3)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--events", action="store_true", help="CUDA events around each launch, no profiler")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs CUDA (the device's own timeline)", file=sys.stderr)
        return 2
    from draftgraph.runtime.decode.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    print(f"# profile_decode: {torch.cuda.get_device_name()}, K={args.num_drafts}, {args.max_tokens} tokens a "
          f"sequence; a step (greedy: a token), the prefill included; host gap: median; outside: device ops "
          f"no graph launched")
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [tok.encode(bench.PROMPTS[i % len(bench.PROMPTS)], add_bos=True) for i in range(b)]
        print(f"B={b}")
        print("\n".join(profile_batch(args.checkpoint, prompts, args.max_tokens, args.num_drafts, args.events)))
    print(f"# argv: {' '.join(sys.argv[1:] if argv is None else argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
