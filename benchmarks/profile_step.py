"""Where a captured draft step spends its time: GPU kernels by name, per step (GPU).

CUPTI traces each kernel node of a replayed CUDA graph, so a profiler around a
few replays gives every kernel's duration. The table groups kernels by name and
shows launches and µs per draft step, and the share of the replay that is
kernels at all (the rest is launch gaps inside the graph). ``op_table`` times each
step of the chain alone, captured into its own CUDA graph: the op's own critical path,
its side lanes joined at its end. Used by ``benchmarks/bench_draft.py --profile``; callable
on any CapturedExecutor (after one replay, so every step reads real values).
"""

from __future__ import annotations

from collections import defaultdict

import torch


def kernel_table(executor, num_drafts: int, replays: int = 20) -> tuple[list[tuple[str, float, float]], float]:
    """[(kernel name, launches per step, µs per step)] by µs, and the kernels' total µs per step."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        executor.replay()  # as a propose launches it (node priorities kept)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            executor.replay()
        torch.cuda.synchronize()
    launches: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches[event.name] += 1
            micros[event.name] += event.device_time
    steps = replays * num_drafts
    rows = sorted(((n, launches[n] / steps, micros[n] / steps) for n in launches), key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def print_kernel_table(title: str, rows, total_us: float, replay_us: float, top: int = 25) -> None:
    print(f"\n{title}: kernels {total_us:.1f} µs of a {replay_us:.1f} µs step "
          f"({total_us / replay_us:.0%} busy), {sum(r[1] for r in rows):.1f} launches per step")
    print(f"  {'µs/step':>8} {'launches':>8}  kernel")
    for name, n, us in rows[:top]:
        print(f"  {us:>8.1f} {n:>8.1f}  {name[:110]}")
    if len(rows) > top:
        rest = rows[top:]
        print(f"  {sum(r[2] for r in rest):>8.1f} {sum(r[1] for r in rest):>8.1f}  ({len(rest)} more kernels)")


def op_table(executor, replays: int = 50) -> list[tuple[str, str, float]]:
    """[(node name, op, µs)]: each ungated step of the chain replayed alone, in its own CUDA graph.

    A step reads what the last replay left in the arena; in-place steps (hc_post) and the
    cache write repeat on every replay, which changes values but not the kernels run.
    """
    eager, inputs = executor.eager, executor.static_inputs
    stream = torch.cuda.Stream(device=executor.device)
    rows = []
    for flag, steps in eager.segments:
        if flag is not None:
            continue  # a gated region's steps run inside a conditional node
        for step in steps:
            stream.wait_stream(torch.cuda.current_stream(executor.device))
            with torch.cuda.stream(stream):
                eager._run_steps([step], inputs)  # warm-up: cuBLAS workspaces outside the capture
            torch.cuda.current_stream(executor.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=executor.pool, stream=stream):
                eager._run_steps([step], inputs)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            rows.append((step.node.name, step.node.op, start.elapsed_time(end) * 1e3 / replays))
            graph.reset()
    return rows


def print_op_table(title: str, rows, replay_us: float) -> None:
    total = sum(r[2] for r in rows)
    print(f"\n{title}: {len(rows)} steps, {total:.1f} µs alone in all against a {replay_us:.1f} µs replay")
    print(f"  {'µs':>8}  op                 step")
    for name, op, us in rows:
        print(f"  {us:>8.1f}  {op:<18} {name}")
